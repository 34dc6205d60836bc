// The torch headers every kernel source includes, compiled once per level.
//
// kernels/native.py precompiles this header with a level's flags and puts it
// in front of each source whose own flags leave the precompiled form valid
// (native.PCH_NEUTRAL_FLAGS): parsing torch's headers is ~60% of a source's
// compile time at -O3 (g++ 12, 2-core Intel Xeon with AMX: -fsyntax-only 9-11 s of
// a 15-17 s compile); all five levels built in 3m54s with it, 6m19s without. Sources still include what they use themselves; the
// include guards make those lines free, and a source compiled without the
// precompiled form (other flags, another compiler) builds the same.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
