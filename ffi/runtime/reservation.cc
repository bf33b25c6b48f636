// The reservation's table, handles, counters and checks (kvcm/runtime/reservation.h), shared by
// the memfd and the VMM backends.
#include "kvcm/runtime/reservation.h"

#include <algorithm>
#include <new>
#include <string>
#include <utility>

#include "kvcm/runtime/errors.h"

namespace kvcm::runtime {

// How an error names the argument: "offset 4096" for a single call, "offsets[3] = 4096" in a batch.
struct Reservation::Arg {
  const char* name;
  int64_t index = -1;

  std::string Label() const {
    return index < 0 ? name : std::string(name) + "[" + std::to_string(index) + "]";
  }
  std::string Describe(int64_t value) const {
    return Label() + (index < 0 ? " " : " = ") + std::to_string(value);
  }
};

namespace {

// InvalidArgument naming the later of two equal values of `values` (an argument of a batch call).
void CheckDistinct(const std::vector<int64_t>& values, const char* name) {
  std::vector<std::pair<int64_t, int64_t>> sorted;  // (value, index)
  sorted.reserve(values.size());
  for (size_t k = 0; k < values.size(); ++k) sorted.emplace_back(values[k], k);
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 1; k < sorted.size(); ++k) {
    if (sorted[k].first == sorted[k - 1].first) {
      throw InvalidArgument(std::string(name) + "[" + std::to_string(sorted[k].second) + "] = " +
                            std::to_string(sorted[k].first) + " repeats " + name + "[" +
                            std::to_string(sorted[k - 1].second) + "]");
    }
  }
}

}  // namespace

Reservation::Reservation(std::unique_ptr<ReservationBackend> backend, int64_t nbytes,
                         int64_t super_page_bytes)
    : backend_(std::move(backend)) {
  const int64_t gran = static_cast<int64_t>(backend_->granularity());
  if (super_page_bytes <= 0 || super_page_bytes % gran != 0) {
    throw InvalidArgument("super_page_bytes must be a positive multiple of the " +
                          std::string(backend_->name()) + " granularity " +
                          std::to_string(gran) + ", got " + std::to_string(super_page_bytes));
  }
  if (nbytes <= 0 || nbytes % super_page_bytes != 0) {
    throw InvalidArgument("nbytes must be a positive multiple of super_page_bytes (" +
                          std::to_string(super_page_bytes) + "), got " + std::to_string(nbytes));
  }
  nbytes_ = static_cast<size_t>(nbytes);
  super_page_bytes_ = static_cast<size_t>(super_page_bytes);
  base_ = backend_->Reserve(nbytes_, super_page_bytes_);  // NOTE: freed by ~backend_ on a throw
  try {
    mapping_.assign(nbytes_ / super_page_bytes_, kUnmapped);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory("cannot allocate the arena's table of " +
                      std::to_string(nbytes_ / super_page_bytes_) + " super-pages");
  }
  open_ = true;
  backend_->Opened(*this);
}

// -- physical super-pages ------------------------------------------------------------------------

int64_t Reservation::CreatePhysical() {
  CheckOpen();
  return CreateOne();
}

std::vector<int64_t> Reservation::CreatePhysicalMany(int64_t n) {
  CheckOpen();
  if (n < 0) throw InvalidArgument("n must be >= 0, got " + std::to_string(n));
  const ReservationCounters before = counters_;
  std::vector<int64_t> handles;
  handles.reserve(static_cast<size_t>(n));
  try {
    while (static_cast<int64_t>(handles.size()) < n) handles.push_back(CreateOne());
  } catch (...) {
    // NOTE: released newest first, so the free ids come back in their old order.
    for (auto h = handles.rbegin(); h != handles.rend(); ++h) {
      try {
        ReleaseOne(*h);
      } catch (...) {  // the handle stays live (and counted): the table stays true
      }
    }
    RestoreCallCounters(before);
    throw;
  }
  return handles;
}

void Reservation::ReleasePhysical(int64_t handle) {
  CheckOpen();
  CheckReleasable(handle, {"handle"});
  ReleaseOne(handle);
}

void Reservation::ReleasePhysicalMany(const std::vector<int64_t>& handles) {
  CheckOpen();
  for (size_t k = 0; k < handles.size(); ++k) {
    CheckReleasable(handles[k], {"handles", static_cast<int64_t>(k)});
  }
  CheckDistinct(handles, "handles");
  for (int64_t h : handles) ReleaseOne(h);
}

int64_t Reservation::CreateOne() {
  const bool reuse = !free_ids_.empty();
  const int64_t id = reuse ? free_ids_.back() : static_cast<int64_t>(physical_.size());
  if (!reuse) {
    // NOTE: room first, so that no allocation can fail once the backend holds memory for it
    // (ReleaseOne's push_back included).
    physical_.emplace_back();
    free_ids_.reserve(physical_.size());
  }
  uint64_t backend_handle;
  try {
    FailIfInjected(create_fault_, "create");
    backend_handle = backend_->CreatePhysical(id);
  } catch (...) {
    if (!reuse) physical_.pop_back();
    throw;
  }
  if (reuse) free_ids_.pop_back();
  physical_[id] = {backend_handle, 0};
  ++counters_.create_calls;
  ++counters_.physical;
  return id;
}

void Reservation::ReleaseOne(int64_t handle) {
  backend_->ReleasePhysical(physical_[handle].backend_handle);  // throws: nothing changed
  physical_[handle].refs = -1;
  free_ids_.push_back(handle);
  ++counters_.release_calls;
  --counters_.physical;
}

// -- the map table -------------------------------------------------------------------------------

void Reservation::Map(int64_t offset, int64_t handle) {
  CheckOpen();
  const size_t index = CheckUnmapped(offset, {"offset"});
  CheckLive(handle, {"handle"});
  MapIndex(index, handle);
}

void Reservation::MapMany(const std::vector<int64_t>& offsets,
                          const std::vector<int64_t>& handles) {
  CheckOpen();
  if (offsets.size() != handles.size()) {
    throw InvalidArgument("offsets and handles must have the same length, got " +
                          std::to_string(offsets.size()) + " and " +
                          std::to_string(handles.size()));
  }
  std::vector<size_t> indices(offsets.size());
  for (size_t k = 0; k < offsets.size(); ++k) {
    indices[k] = CheckUnmapped(offsets[k], {"offsets", static_cast<int64_t>(k)});
    CheckLive(handles[k], {"handles", static_cast<int64_t>(k)});
  }
  CheckDistinct(offsets, "offsets");
  const ReservationCounters before = counters_;
  size_t done = 0;
  try {
    for (; done < indices.size(); ++done) MapIndex(indices[done], handles[done]);
  } catch (...) {
    while (done-- > 0) {
      try {
        UnmapIndex(indices[done]);
      } catch (...) {  // it stays mapped (and counted): the table stays true
      }
    }
    RestoreCallCounters(before);
    throw;
  }
}

void Reservation::Unmap(int64_t offset) {
  CheckOpen();
  UnmapIndex(CheckMapped(offset, {"offset"}));
}

void Reservation::UnmapMany(const std::vector<int64_t>& offsets) {
  CheckOpen();
  std::vector<size_t> indices(offsets.size());
  for (size_t k = 0; k < offsets.size(); ++k) {
    indices[k] = CheckMapped(offsets[k], {"offsets", static_cast<int64_t>(k)});
  }
  CheckDistinct(offsets, "offsets");
  for (size_t index : indices) UnmapIndex(index);
}

bool Reservation::IsMapped(int64_t offset) const {
  if (!open_) return false;
  return mapping_[SuperPageIndex(offset, {"offset"})] != kUnmapped;
}

int64_t Reservation::HandleAt(int64_t offset) const {
  CheckOpen();
  return mapping_[SuperPageIndex(offset, {"offset"})];
}

void Reservation::MapIndex(size_t index, int64_t handle) {
  FailIfInjected(map_fault_, "map");
  backend_->Map(index * super_page_bytes_, physical_[handle].backend_handle);
  {
    std::lock_guard<std::mutex> lock(table_mu_);
    mapping_[index] = handle;
  }
  ++physical_[handle].refs;
  ++counters_.map_calls;
  ++counters_.mapped;
}

void Reservation::UnmapIndex(size_t index) {
  const int64_t handle = mapping_[index];
  {
    // NOTE: lookups see the super-page unmapped before its pages go.
    std::lock_guard<std::mutex> lock(table_mu_);
    mapping_[index] = kUnmapped;
  }
  try {
    backend_->Unmap(index * super_page_bytes_);
  } catch (...) {
    std::lock_guard<std::mutex> lock(table_mu_);
    mapping_[index] = handle;
    throw;
  }
  --physical_[handle].refs;
  ++counters_.unmap_calls;
  --counters_.mapped;
}

bool Reservation::RangeMapped(size_t offset, size_t nbytes) const {
  std::lock_guard<std::mutex> lock(table_mu_);
  if (!open_) return false;
  for (size_t i = offset / super_page_bytes_; i <= (offset + nbytes - 1) / super_page_bytes_; ++i) {
    if (mapping_[i] == kUnmapped) return false;
  }
  return true;
}

void Reservation::RestoreCallCounters(const ReservationCounters& before) {
  counters_.map_calls = before.map_calls;
  counters_.unmap_calls = before.unmap_calls;
  counters_.create_calls = before.create_calls;
  counters_.release_calls = before.release_calls;
}

void Reservation::InjectFault(const std::string& kind, int64_t after) {
  if (after < 0) throw InvalidArgument("after must be >= 0, got " + std::to_string(after));
  if (kind == "create") {
    create_fault_ = after;
  } else if (kind == "map") {
    map_fault_ = after;
  } else {
    throw InvalidArgument("kind must be \"create\" or \"map\", got " + kind);
  }
}

void Reservation::FailIfInjected(int64_t& countdown, const char* kind) {
  if (countdown < 0) return;
  if (countdown-- == 0) throw OutOfMemory(std::string("injected fault: ") + kind);
}

// -- bytes ---------------------------------------------------------------------------------------

void Reservation::Read(int64_t offset, uintptr_t dst_address, int64_t nbytes) {
  CheckMappedSpan(offset, nbytes, dst_address, "dst_address");
  if (nbytes > 0) {
    backend_->CopyOut(reinterpret_cast<void*>(dst_address), static_cast<size_t>(offset),
                      static_cast<size_t>(nbytes));
  }
}

void Reservation::Write(int64_t offset, uintptr_t src_address, int64_t nbytes) {
  CheckMappedSpan(offset, nbytes, src_address, "src_address");
  if (nbytes > 0) {
    backend_->CopyIn(static_cast<size_t>(offset), reinterpret_cast<const void*>(src_address),
                     static_cast<size_t>(nbytes));
  }
}

uintptr_t Reservation::ViewAddress(int64_t offset, uint64_t nbytes) const {
  CheckOpen();
  if (offset < 0 || static_cast<uint64_t>(offset) > nbytes_ ||
      nbytes > nbytes_ - static_cast<uint64_t>(offset)) {
    throw InvalidArgument("shape and offset describe bytes outside the reservation: " +
                          std::to_string(nbytes) + " bytes at offset " + std::to_string(offset) +
                          " of " + std::to_string(nbytes_));
  }
  return base_ + static_cast<uintptr_t>(offset);
}

// -- closing -------------------------------------------------------------------------------------

void Reservation::Close() noexcept {
  if (!open_) return;
  backend_->Closing(*this);
  for (size_t i = 0; i < mapping_.size(); ++i) {
    if (mapping_[i] == kUnmapped) continue;
    try {
      UnmapIndex(i);
    } catch (...) {  // NOTE: it stays mapped (and counted); freeing the reservation reclaims it
    }
  }
  for (Physical& p : physical_) {
    if (p.refs < 0) continue;
    try {
      backend_->ReleasePhysical(p.backend_handle);
    } catch (...) {  // e.g. the driver is unloading at interpreter exit
    }
    p.refs = -1;
    ++counters_.release_calls;
    --counters_.physical;
  }
  {
    std::lock_guard<std::mutex> lock(table_mu_);
    open_ = false;
    mapping_ = {};
  }
  physical_ = {};
  free_ids_ = {};
  backend_->Free();
}

// -- checks --------------------------------------------------------------------------------------

void Reservation::CheckOpen() const {
  if (!open_) throw InvalidArgument("the arena reservation is closed");
}

size_t Reservation::SuperPageIndex(int64_t offset, const Arg& arg) const {
  if (offset < 0 || static_cast<size_t>(offset) >= nbytes_ ||
      static_cast<size_t>(offset) % super_page_bytes_ != 0) {
    throw InvalidArgument(arg.Label() + " must be a multiple of super_page_bytes (" +
                          std::to_string(super_page_bytes_) + ") inside the reservation (" +
                          std::to_string(nbytes_) + " bytes), got " + std::to_string(offset));
  }
  return static_cast<size_t>(offset) / super_page_bytes_;
}

size_t Reservation::CheckUnmapped(int64_t offset, const Arg& arg) const {
  const size_t index = SuperPageIndex(offset, arg);
  if (mapping_[index] != kUnmapped) {
    throw InvalidArgument(arg.Describe(offset) + " is already mapped");
  }
  return index;
}

size_t Reservation::CheckMapped(int64_t offset, const Arg& arg) const {
  const size_t index = SuperPageIndex(offset, arg);
  if (mapping_[index] == kUnmapped) {
    throw InvalidArgument(arg.Describe(offset) + " is not mapped");
  }
  return index;
}

void Reservation::CheckLive(int64_t handle, const Arg& arg) const {
  if (handle < 0 || handle >= static_cast<int64_t>(physical_.size()) ||
      physical_[handle].refs < 0) {
    throw InvalidArgument(arg.Describe(handle) + " is not a live physical handle of this arena");
  }
}

void Reservation::CheckReleasable(int64_t handle, const Arg& arg) const {
  CheckLive(handle, arg);
  if (physical_[handle].refs > 0) {
    throw InvalidArgument(arg.Describe(handle) + " is still mapped at " +
                          std::to_string(physical_[handle].refs) + " offset(s); unmap it first");
  }
}

void Reservation::CheckMappedSpan(int64_t offset, int64_t nbytes, uintptr_t address,
                                  const char* address_name) const {
  CheckOpen();
  if (offset < 0 || static_cast<size_t>(offset) > nbytes_) {
    throw InvalidArgument("offset must be inside the reservation (" + std::to_string(nbytes_) +
                          " bytes), got " + std::to_string(offset));
  }
  if (nbytes < 0 || static_cast<size_t>(nbytes) > nbytes_ - static_cast<size_t>(offset)) {
    throw InvalidArgument("nbytes must be >= 0 and end inside the reservation (" +
                          std::to_string(nbytes_) + " bytes), got " + std::to_string(nbytes) +
                          " at offset " + std::to_string(offset));
  }
  if (nbytes == 0) return;
  if (address == 0) throw InvalidArgument(std::string(address_name) + " is null");
  const size_t first = static_cast<size_t>(offset) / super_page_bytes_;
  const size_t last = static_cast<size_t>(offset + nbytes - 1) / super_page_bytes_;
  for (size_t i = first; i <= last; ++i) {
    if (mapping_[i] == kUnmapped) {
      throw InvalidArgument("offset " + std::to_string(offset) + " + nbytes " +
                            std::to_string(nbytes) + " touches the unmapped super-page at offset " +
                            std::to_string(i * super_page_bytes_));
    }
  }
}

}  // namespace kvcm::runtime
