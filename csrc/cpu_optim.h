// cpu_optim.h — fused CPU optimizer steps (Adam/AdamW, SGD, Adagrad) over fp32 tensors.
//
// One pass per element reads p, g and the state, writes p and the state, and
// optionally a 16-bit copy of the new p (the parameters a GPU or a low-precision
// model reads next). A gradient scale (1/loss_scale times a clip coefficient)
// is applied to g in the same pass.
//
// Numerics mirror torch.optim with foreach=False on a CPU with FMA: every
// scalar is rounded to fp32 first (Python computes the bias corrections in
// double and hands over the fp32 results), and the elementwise ops are the
// ones torch's vectorised kernels run, fused multiply-adds included:
//   add(alpha)   a + alpha*b   = fma(b, alpha, a)
//   lerp(w)      |w| < 0.5 ? fma(w, e - s, s) : fma(w - 1, e - s, e)
//   addcmul(c)   a + c*b*b     = fma(c*b, b, a)
//   addcdiv(c)   a + c*b/d     = a + (c*b)/d
// Everything else (mul, div, sqrt, max) is a single correctly rounded op. The
// one known difference is sqrt: torch calls MKL's vsSqrt, which is within
// 1 ulp but not always correctly rounded; here sqrt is exact, so a step can
// differ from torch's by 1 ulp of the update. The scalar path (std::fma) and
// the AVX2 and AVX-512 paths give bitwise identical results.
//
// Python owns every buffer; C++ borrows them for the duration of the call.
#pragma once

#include <cstdint>
#include <vector>

#include "reduce_math.h"

namespace pz {

// Instruction set of the vector loop; chosen at run time unless forced.
enum class Isa : int32_t { scalar = 0, avx2 = 1, avx512 = 2, best = -1 };
const char* isa_name(Isa isa);
Isa best_isa();  // the widest one this CPU (and OS) supports
// Where a multi-threaded step's pieces run: "openmp" (the OpenMP runtime already
// in the process, torch's) or "threads" (threads started per step).
const char* threading_name();

// One tensor of a step: all fp32 and `n` elements long. `state2` is Adam's
// max_exp_avg_sq (amsgrad) and otherwise unused; `copy` (may be null) gets
// cast<copy_dtype>(new p).
struct OptimSlot {
  float* p;
  const float* g;
  float* state0;  // Adam: exp_avg; SGD: momentum_buffer; Adagrad: sum
  float* state1;  // Adam: exp_avg_sq (Adam with bf16_moments: state0 and state1 hold bfloat16)
  float* state2;  // Adam with amsgrad: max_exp_avg_sq
  void* copy;
  int64_t n;
};

// The fp32 scalars of one Adam/AdamW step (see the formula in the .cpp).
struct AdamScalars {
  float grad_scale = 1.0f;   // g *= grad_scale first (1/loss_scale * clip coefficient)
  float weight_decay = 0.0f; // L2 (Adam): g = fma(p, wd, g)
  float decay = 1.0f;        // decoupled (AdamW): p *= decay, decay = 1 - lr*wd
  float lerp_weight = 0.1f;  // 1 - beta1
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.0f;
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;  // -lr / (1 - beta1^step)
  bool decoupled = true;
  bool amsgrad = false;
  bool maximize = false;
  // exp_avg and exp_avg_sq stored as bfloat16: read widened, updated in fp32 as above, written
  // rounded to nearest even (the fp32 step from the stored values, its moments rounded)
  bool bf16_moments = false;
};

struct SgdScalars {
  float grad_scale = 1.0f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float neg_lr = -1e-3f;
  bool nesterov = false;
  bool maximize = false;
  bool first_step = false;  // momentum buffers are set to g instead of updated
};

struct AdagradScalars {
  float grad_scale = 1.0f;
  float weight_decay = 0.0f;
  float neg_clr = -1e-2f;  // -lr / (1 + (step - 1) * lr_decay)
  float eps = 1e-10f;
  bool maximize = false;
};

// One tensor of an Adam step with 8-bit moments (pyzero/optim/moments.py): exp_avg as int8
// codes c (m = m_absmax[b] * (c/127)^3), exp_avg_sq as uint8 codes (v = v_absmax[b] *
// (c/255)^4), one absmax per block b of 256 elements (the last one may be shorter).
struct Q8Slot {
  float* p;
  const float* g;
  int8_t* m;
  float* m_absmax;
  uint8_t* v;
  float* v_absmax;
  void* copy;
  int64_t n;
};
constexpr int64_t kQ8Block = 256;

// Steps every slot; work is split over `threads` threads (the caller's thread
// is one of them) in contiguous chunks. copy_dtype: f32, f16 or bf16.
void adam_step(const std::vector<OptimSlot>& slots, const AdamScalars& s, DType copy_dtype, int threads, Isa isa);
void sgd_step(const std::vector<OptimSlot>& slots, const SgdScalars& s, DType copy_dtype, int threads, Isa isa);
void adagrad_step(const std::vector<OptimSlot>& slots, const AdagradScalars& s, DType copy_dtype, int threads,
                  Isa isa);
// Adam/AdamW with 8-bit moments, block by block: the block's moments decoded into fp32, the
// fp32 step of adam_step on them (bitwise its arithmetic), the new moments encoded (each
// block's absmax, codes rounded to nearest in the root domain, a positive v never code 0).
// Threads split the blocks. amsgrad and bf16_moments must be off.
void adam_step_q8(const std::vector<Q8Slot>& slots, const AdamScalars& s, DType copy_dtype, int threads, Isa isa);

}  // namespace pz
