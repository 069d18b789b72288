/* The decode stack with its phase marks on (bench/decode_phases.py): each phase's time stamp counter ticks, per
 * step, on the first thread. The engine's own build (engine/executor/kernels/csrc/decode_stack.c) has none. */
#define CBSERVE_PHASE_TIMES 1
#include "../../engine/executor/kernels/csrc/decode_stack.c"
