// Python class ``Reservation`` and ``reservation_granularity()`` over kvcm::runtime::Reservation,
// the same in both extension modules; each module binds it with its backend (memfd_binding.cc in
// _kvcm_cpu, vmm_binding.cc in _kvcm_cuda).
//
// NOTE: nanobind registers a C++ type once per process, by name, and both modules may be loaded:
// each binds its own type, PyReservation<its tag>.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "byte_view.h"
#include "dlpack_dtype.h"
#include "kvcm/runtime/errors.h"
#include "kvcm/runtime/reservation.h"

namespace kvcm::runtime {

template <class ModuleTag>
class PyReservation : public Reservation {
 public:
  using Reservation::Reservation;
};

namespace binding_detail {

namespace nb = nanobind;

inline void TranslateErrors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const OutOfMemory& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const DriverError& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  }
}

// A zero-copy array of `shape` / `dtype` at byte `offset` of `r` (the object `self`), which it
// keeps alive.
inline nb::ndarray<nb::array_api> DLPackView(nb::handle self, const Reservation& r, int64_t offset,
                                             const std::vector<size_t>& shape,
                                             const std::string& dtype) {
  const DLPackDType& dt = ViewDType(dtype);
  uint64_t nbytes = dt.bits / 8;
  for (size_t extent : shape) {
    if (extent != 0 && nbytes > UINT64_MAX / extent) {
      throw InvalidArgument("shape describes more bytes than 64 bits can count");
    }
    nbytes *= extent;
  }
  void* data = reinterpret_cast<void*>(r.ViewAddress(offset, nbytes));
  const int device = r.backend().device();
  return nb::ndarray<nb::array_api>(data, shape.size(), shape.data(), self, nullptr,
                                    nb::dlpack::dtype{dt.code, dt.bits, 1},
                                    r.backend().dlpack_device_type(), device < 0 ? 0 : device);
}

inline ByteView HostView(nb::handle self, const Reservation& r) {
  void* data = reinterpret_cast<void*>(r.ViewAddress(0, r.nbytes()));  // checks it is open
  if (r.backend().dlpack_device_type() != nb::device::cpu::value) {
    throw InvalidArgument(std::string("view() needs host memory; the ") + r.backend().name() +
                          " backend's is on the device: use dlpack()");
  }
  return ByteViewOf(self, data, r.nbytes());
}

inline nb::tuple DTypeNames() {
  nb::list names;
  for (const DLPackDType& d : kViewDTypes) names.append(d.name);
  return nb::tuple(names);
}

}  // namespace binding_detail

template <class ModuleTag>
void BindReservation(nanobind::module_& m, const BackendFactory& factory) {
  namespace nb = nanobind;
  using Py = PyReservation<ModuleTag>;
  nb::register_exception_translator(binding_detail::TranslateErrors);
  const std::string backend = factory.name;
  const auto open = factory.open;
  const auto granularity = factory.granularity;
  const std::string granularity_doc =
      "The smallest super-page the " + backend + " backend accepts" +
      (factory.takes_device ? " on ``device`` (-1: the current one); RuntimeError when the "
                              "driver or device has no VMM support."
                            : " (the system page size).");
  if (factory.takes_device) {
    m.def("reservation_granularity", [granularity](int device) {
      return static_cast<int64_t>(granularity(device));
    }, nb::arg("device") = -1, granularity_doc.c_str());
  } else {
    m.def("reservation_granularity", [granularity]() {
      return static_cast<int64_t>(granularity(-1));
    }, granularity_doc.c_str());
  }

  const std::string doc =
      "A virtual reservation of ``nbytes`` whose super-pages are backed on demand by physical "
      "super-pages (" + backend + " backend); one handle may be mapped at several offsets.";
  nb::class_<Py> cls(m, "Reservation", doc.c_str());
  if (factory.takes_device) {
    cls.def("__init__", [open](Py* self, int64_t nbytes, int64_t super_page_bytes, int device) {
      new (self) Py(open(device), nbytes, super_page_bytes);
    }, nb::arg("nbytes"), nb::arg("super_page_bytes"), nb::arg("device") = -1);
  } else {
    cls.def("__init__", [open](Py* self, int64_t nbytes, int64_t super_page_bytes) {
      new (self) Py(open(-1), nbytes, super_page_bytes);
    }, nb::arg("nbytes"), nb::arg("super_page_bytes"));
  }
  cls.def("create_physical", &Reservation::CreatePhysical)
      .def("create_physical_many", &Reservation::CreatePhysicalMany, nb::arg("n"))
      .def("release_physical", &Reservation::ReleasePhysical, nb::arg("handle"))
      .def("release_physical_many", &Reservation::ReleasePhysicalMany, nb::arg("handles"))
      .def("map", &Reservation::Map, nb::arg("offset"), nb::arg("handle"))
      .def("map_many", &Reservation::MapMany, nb::arg("offsets"), nb::arg("handles"))
      .def("unmap", &Reservation::Unmap, nb::arg("offset"))
      .def("unmap_many", &Reservation::UnmapMany, nb::arg("offsets"))
      .def("is_mapped", &Reservation::IsMapped, nb::arg("offset"))
      .def("handle_at", &Reservation::HandleAt, nb::arg("offset"))
      .def("read", &Reservation::Read, nb::arg("offset"), nb::arg("dst_address"),
           nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>())
      .def("write", &Reservation::Write, nb::arg("offset"), nb::arg("src_address"),
           nb::arg("nbytes"), nb::call_guard<nb::gil_scoped_release>())
      .def("dlpack", [](nb::handle self, int64_t offset, const std::vector<size_t>& shape,
                        const std::string& dtype) {
        return binding_detail::DLPackView(self, nb::cast<Py&>(self), offset, shape, dtype);
      }, nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"))
      .def("view", [](nb::handle self) {
        return binding_detail::HostView(self, nb::cast<Py&>(self));
      })
      .def("close", &Reservation::Close)
      .def("_inject_fault", &Reservation::InjectFault, nb::arg("kind"), nb::arg("after") = 0,
           "Test hook: the (after + 1)-th following physical create ('create') or map ('map') "
           "fails with MemoryError, once.")
      .def_prop_ro("backend", [](const Py& r) { return std::string(r.backend().name()); })
      .def_prop_ro("device", [](const Py& r) { return r.backend().device(); })
      .def_prop_ro("base", &Reservation::base)
      .def_prop_ro("nbytes", &Reservation::nbytes)
      .def_prop_ro("super_page_bytes", &Reservation::super_page_bytes)
      .def_prop_ro("closed", &Reservation::closed)
      .def_prop_ro("num_map_calls", [](const Py& r) { return r.counters().map_calls; })
      .def_prop_ro("num_unmap_calls", [](const Py& r) { return r.counters().unmap_calls; })
      .def_prop_ro("num_create_calls", [](const Py& r) { return r.counters().create_calls; })
      .def_prop_ro("num_release_calls", [](const Py& r) { return r.counters().release_calls; })
      .def_prop_ro("num_physical", [](const Py& r) { return r.counters().physical; })
      .def_prop_ro("mapped_bytes", [](const Py& r) {
        return r.counters().mapped * static_cast<int64_t>(r.super_page_bytes());
      })
      .def_prop_ro("physical_bytes", [](const Py& r) {
        return r.counters().physical * static_cast<int64_t>(r.super_page_bytes());
      });
  cls.attr("dtypes") = binding_detail::DTypeNames();
}

}  // namespace kvcm::runtime
