// Stand-in for CUDA's cuda_bf16.h when kernels/*.cu are compiled as host C++.
#pragma once
#include "cuda_emu.h"
