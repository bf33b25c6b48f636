// CPU handlers of the cold-page codecs (stub).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void AddCodecRegistrations(nb::dict& d) { (void)d; }
