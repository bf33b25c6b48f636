// _kvcm_cuda.Reservation: the reservation on the CUDA VMM backend (reservation_binding.h).
#include "reservation_binding.h"

namespace {
struct CudaModule {};  // this module's own bound type (see reservation_binding.h)
}  // namespace

void BindVmmReservation(nanobind::module_& m) {
  kvcm::runtime::BindReservation<CudaModule>(m, kvcm::runtime::VmmBackendFactory());
}
