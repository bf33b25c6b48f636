// Host tier memory: aligned host buffers owned by the extension (stub; filled in by the host-tier work).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void BindHostMemory(nb::module_& m) { (void)m; }
