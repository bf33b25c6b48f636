// Pinned, mapped host memory for the host tier on CUDA builds (stub).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void BindPinnedMemory(nb::module_& m) { (void)m; }
