// The one by-value argument of the simulator test kernels that simkit.args() builds: this struct and
// tests/sim/simkit.py's ARGS_DTYPE are the same layout (four pointers, six 32-bit words), written once here.
#pragma once

namespace simkit {

struct Args {
  void* in0;
  void* in1;
  void* out0;
  void* out1;
  int n;
  int mode;
  int width;
  unsigned mask;
  int extra;
  int pad;
};

}  // namespace simkit
