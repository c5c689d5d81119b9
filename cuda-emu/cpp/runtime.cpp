// runtime.cpp: runs one kernel launch of kernels/*.cu on the calling thread (see
// cuda_emu.h for the execution model). Entry point for the Rust side: emu_launch.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_emu.h"
#include "registry.h"

thread_local EmuCoords emu_coords;

// Fiber switch without a system call (glibc's swapcontext saves the signal mask, a system
// call per switch: too slow for kernels that reach a barrier tens of times per row).
// emu_switch(save, next): pushes the callee-saved registers, stores the stack pointer in
// *save, loads `next` and pops the registers saved there. x86-64 System V only.
#if !defined(__x86_64__)
#error "cuda-emu's fiber switch is written for x86-64"
#endif
extern "C" void emu_switch(void** save, void* next);
asm(R"(
  .text
  .globl emu_switch
  .type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch, .-emu_switch
)");

namespace {

constexpr size_t kStack = 64 * 1024;  // per CUDA thread; kernels use a few hundred bytes
constexpr unsigned kMaxThreads = 1024;

struct Fiber {
  void* sp;
  bool done;
};

// Per OS thread: the block being run.
struct Block {
  const EmuKernel* kernel = nullptr;
  void** params = nullptr;
  bool fibers = false;         // running as fibers (barriers allowed)
  unsigned current = 0;        // the fiber running now
  void* scheduler = nullptr;   // the scheduler's saved stack pointer
  std::vector<Fiber> threads;
  char* stacks = nullptr;      // kMaxThreads stacks, mapped once per OS thread
  uint64_t slots[2][kMaxThreads];     // warp shuffle exchange (cuda_emu.h)
  uint32_t shuffles[kMaxThreads];     // shuffles each thread has started
};

// One pointer per OS thread (plain: no TLS wrapper call); the Block itself is
// allocated on the thread's first launch and lives as long as the process.
thread_local Block* tls_block = nullptr;

Block& this_block() {
  Block* b = tls_block;
  if (b == nullptr) b = tls_block = new Block();
  return *b;
}

// First frame of every fiber: runs the thread's kernel body, then hands back for good.
void fiber_main() {
  Block& block = this_block();
  block.kernel->call(block.params);
  Fiber& f = block.threads[block.current];
  f.done = true;
  emu_switch(&f.sp, block.scheduler);
  abort();  // a finished fiber is never resumed
}

// A fresh stack for fiber t whose first switch "returns" into fiber_main with the stack
// aligned as at a call (rsp + 8 a multiple of 16).
void* initial_stack(unsigned t) {
  Block& block = this_block();
  uintptr_t top = reinterpret_cast<uintptr_t>(block.stacks + (size_t)(t + 1) * kStack) & ~(uintptr_t)15;
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                      // fiber_main's return address slot
  *--sp = reinterpret_cast<void*>(&fiber_main);         // popped by emu_switch's ret
  for (int r = 0; r < 6; ++r) *--sp = nullptr;          // rbp rbx r12 r13 r14 r15
  return sp;
}

void run_block_as_fibers(unsigned nthreads) {
  Block& block = this_block();
  if (block.stacks == nullptr) {
    void* p = mmap(nullptr, kStack * kMaxThreads, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      fprintf(stderr, "cuda-emu: cannot map fiber stacks\n");
      abort();
    }
    block.stacks = static_cast<char*>(p);
  }
  block.threads.assign(nthreads, Fiber{});
  for (unsigned t = 0; t < nthreads; ++t) {
    block.threads[t] = Fiber{initial_stack(t), false};
    block.shuffles[t] = 0;
  }
  // Each pass resumes every live thread once; it runs to its next barrier or its end. So
  // every thread finishes phase k (up to barrier k) before any starts phase k + 1.
  for (;;) {
    bool live = false;
    for (unsigned t = 0; t < nthreads; ++t) {
      if (block.threads[t].done) continue;
      block.current = t;
      threadIdx.x = t;
      emu_switch(&block.scheduler, block.threads[t].sp);
      live = live || !block.threads[t].done;
    }
    if (!live) break;
  }
}

}  // namespace

extern "C" void emu_barrier(void) {
  Block& block = this_block();
  if (!block.fibers) {
    fprintf(stderr,
            "cuda-emu: kernel %s reached a barrier, but build.rs found none in its body (add the "
            "helper that waits to BARRIERS in cuda-emu/build.rs)\n",
            block.kernel ? block.kernel->name : "?");
    abort();
  }
  Fiber& f = block.threads[block.current];
  emu_switch(&f.sp, block.scheduler);
  threadIdx.x = block.current;  // the scheduler set it before resuming us; keep it exact
}

extern "C" uint64_t* emu_shuffle_slots(void) {
  Block& block = this_block();
  return block.slots[block.shuffles[threadIdx.x]++ & 1];
}

// Runs `kernel` over grid (gx, gy, gz) x block (bx, 1, 1). Returns 0, or 1 when the
// geometry is one the device refuses (the caller maps it to CUDA_ERROR_INVALID_VALUE).
extern "C" int emu_launch(const EmuKernel* kernel, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, void** params) {
  Block& block = this_block();
  if (bx == 0 || by != 1 || bz != 1 || bx > kMaxThreads || gx == 0 || gy == 0 || gz == 0 ||
      gy > 65535 || gz > 65535)
    return 1;
  block.kernel = kernel;
  block.params = params;
  blockDim.x = bx;
  blockDim.y = blockDim.z = 1;
  gridDim.x = gx;
  gridDim.y = gy;
  gridDim.z = gz;
  threadIdx.y = threadIdx.z = 0;
  block.fibers = kernel->barriers != 0;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx.x = x;
        blockIdx.y = y;
        blockIdx.z = z;
        if (block.fibers) {
          run_block_as_fibers(bx);
        } else {
          for (unsigned t = 0; t < bx; ++t) {
            threadIdx.x = t;
            kernel->call(params);
          }
        }
      }
  block.fibers = false;
  block.kernel = nullptr;
  return 0;
}

extern "C" int emu_check_pointers(const EmuKernel* kernel, void** params) {
  return kernel->check(params);
}

// The parameter sizes of `kernel` (`*n` of them), for copying its arguments at launch.
extern "C" const size_t* emu_param_sizes(const EmuKernel* kernel, size_t* n) {
  *n = kernel->nparams;
  return kernel->sizes;
}

// A fault while a kernel runs (most often past the end of a buffer: each allocation ends at
// an inaccessible page) is named before the process dies; other faults go to the handler
// that was there before (Rust's stack-overflow report).
namespace {
struct sigaction previous_segv;

void on_segv(int sig, siginfo_t* info, void* uctx) {
  const Block* block = tls_block;
  if (block != nullptr && block->kernel != nullptr) {
    char msg[256];
    int n = snprintf(msg, sizeof msg,
                     "cuda-emu: kernel %s (block %u, thread %u) touched unmapped memory at %p "
                     "(past the end of a device allocation?)\n",
                     block->kernel->name, blockIdx.x, threadIdx.x, info->si_addr);
    if (n > 0) (void)!write(2, msg, (size_t)n);
  }
  sigaction(SIGSEGV, &previous_segv, nullptr);
  (void)sig;
  (void)uctx;
}

struct InstallSegv {
  InstallSegv() {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
  }
} install_segv;
}  // namespace

// The 16-bit conversions of cuda_emu.h, for the crate's tests against the `half` crate.
extern "C" uint16_t emu_test_f32_to_f16(float v) { return __float2half_rn(v).bits; }
extern "C" float emu_test_f16_to_f32(uint16_t h) { return __half2float(__half{h}); }
extern "C" uint16_t emu_test_f32_to_bf16(float v) { return __float2bfloat16_rn(v).bits; }
extern "C" float emu_test_bf16_to_f32(uint16_t h) { return __bfloat162float(__nv_bfloat16{h}); }

extern "C" void emu_partial_warp_shuffle(void) {
  const Block* block = tls_block;
  fprintf(stderr, "cuda-emu: kernel %s shuffles with %u threads per block, not a multiple of 32\n",
          block && block->kernel ? block->kernel->name : "?", blockDim.x);
  abort();
}
