// The open CPU arena reservations, for the ops that take an arena pool by address
// (ffi/cpu/arena_ops_cpu.cc): they refuse an address outside an open reservation, or a row on an
// unmapped super-page, with an error instead of a fault. Fed by the reservation's memfd backend
// (ffi/runtime/memfd_backend.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcm {

// True when [address, address + nbytes) lies inside one open reservation.
bool ArenaHolds(uintptr_t address, size_t nbytes);

// True when every super-page [address, address + nbytes) touches is mapped in an open
// reservation (nbytes > 0).
bool ArenaMapped(uintptr_t address, size_t nbytes);

}  // namespace kvcm
