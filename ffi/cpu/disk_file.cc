// Disk tier: slot-addressed preallocated files with per-page checksums (stub).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void BindDiskFile(nb::module_& m) { (void)m; }
