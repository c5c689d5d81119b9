// registry.h: the table of emulated kernels. Each kernels/<file>.cu is compiled in a wrapper
// that build.rs generates: it includes the .cu and lists its extern "C" kernels with
// EMU_KERNEL, so the runtime can call any of them by name with a driver-style parameter
// array (params[i] points at the value of parameter i, as cuLaunchKernel's kernelParams).
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>

extern "C" int emu_pointer_ok(const void* p);

struct EmuKernel {
  const char* name;
  void (*call)(void** params);  // runs the kernel body once, for the current thread/block
  int (*check)(void** params);  // 0 when every pointer argument is null or device memory
  size_t nparams;                // parameters of the kernel
  const size_t* sizes;           // their sizes in bytes (each at most 8)
  int barriers;                  // the body reaches a barrier: run its threads as fibers
};

namespace emu {

template <typename T>
T arg(void** params, size_t i) {
  return *static_cast<T*>(params[i]);
}

template <typename... A, size_t... I>
void call_with(void (*f)(A...), void** p, std::index_sequence<I...>) {
  f(arg<std::remove_cv_t<std::remove_reference_t<A>>>(p, I)...);
}

template <typename T>
int pointer_ok(void** params, size_t i) {
  if constexpr (std::is_pointer_v<T>) {
    return emu_pointer_ok(reinterpret_cast<const void*>(arg<T>(params, i)));
  } else {
    return 1;
  }
}

template <typename... A, size_t... I>
int check_with(void (*)(A...), void** p, std::index_sequence<I...>) {
  return (1 & ... & pointer_ok<std::remove_cv_t<A>>(p, I)) ? 0 : 1;
}

}  // namespace emu

namespace emu {
template <typename... A>
struct Sizes {
  static constexpr size_t value[sizeof...(A) + 1] = {sizeof(A)..., 0};
};
template <typename... A>
constexpr const size_t* sizes(void (*)(A...)) {
  return Sizes<std::remove_cv_t<A>...>::value;
}
}  // namespace emu

#define EMU_KERNEL(NAME, BARRIERS)                                                                     \
  EmuKernel {                                                                                \
    #NAME,                                                                                   \
        [](void** p) {                                                                       \
          emu::call_with(&NAME, p, std::make_index_sequence<emu::arity(&NAME)>{});          \
        },                                                                                   \
        [](void** p) {                                                                       \
          return emu::check_with(&NAME, p, std::make_index_sequence<emu::arity(&NAME)>{});  \
        },                                                                                   \
        emu::arity(&NAME), emu::sizes(&NAME), BARRIERS                                       \
  }

namespace emu {
template <typename... A>
constexpr size_t arity(void (*)(A...)) {
  return sizeof...(A);
}
}  // namespace emu
