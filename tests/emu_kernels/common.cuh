// Included through -I by elementwise.cu: shows that the emulator honours include paths.
#pragma once

__device__ __forceinline__ float scaled(float v) { return SCALE * v; }
