// Which instruction-set level this library was built for (kernels/cpu_isa.py):
// each level is its own library, and this is how a process can tell which one
// it loaded (logs, /metrics, tests).

#include <torch/library.h>

#include <string>

#ifndef KVMESH_ISA
#error "KVMESH_ISA must name the instruction-set level (kernels/native.py sets it)"
#endif

namespace {

std::string isa_level() { return KVMESH_ISA; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("isa_level() -> str", &isa_level); }
