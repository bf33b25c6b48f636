// CUDA handlers of the cold-page codecs (stub).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void AddCodecRegistrationsCuda(nb::dict& d) { (void)d; }
