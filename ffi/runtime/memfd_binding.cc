// _kvcm_cpu.Reservation: the reservation on the memfd backend (reservation_binding.h).
#include "reservation_binding.h"

namespace {
struct CpuModule {};  // this module's own bound type (see reservation_binding.h)
}  // namespace

void BindMemfdReservation(nanobind::module_& m) {
  kvcm::runtime::BindReservation<CpuModule>(m, kvcm::runtime::MemfdBackendFactory());
}
