// Runtime of the Metal-on-CPU emulator: runs a compiled kernel over a grid.
//
// Every GPU thread of a threadgroup gets its own stack and runs the kernel body from
// the top; `threadgroup_barrier` and simdgroup operations are real barriers between
// those threads. Two ways to run them:
//
//   fibers  (default) each GPU thread is a fiber (its own stack, switched in user space);
//           the fibers of one threadgroup take turns on one OS thread and yield at every
//           barrier, so a barrier costs a few context switches, not a kernel wake-up.
//           Whole threadgroups run in parallel on `workers` OS threads.
//   threads each GPU thread is an OS thread (std::thread) and barriers block on
//           condition variables; threadgroups run one after another. Slow, but the
//           threads of a threadgroup really run concurrently.
//
// Simdgroup operations go through a per-simdgroup exchange buffer: each lane writes its
// value, the lanes meet at the simdgroup's barrier, then each reads what it needs (the
// last lane to arrive computes reductions once for all). The buffer is double-buffered
// so one barrier per operation is enough.
//
// Built once into a shared library; kernels are separate libraries that call the
// `emu_*` functions below (declared again in prelude.h).

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 700  // macOS hides the ucontext functions otherwise
#define _DARWIN_C_SOURCE
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if !(defined(__x86_64__) && defined(__linux__)) || defined(ORCHARD_EMU_FORCE_UCONTEXT)
#define ORCHARD_EMU_UCONTEXT 1
#include <ucontext.h>
#endif

extern "C" {

struct emu_thread_info {
  uint32_t thread_position_in_grid[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t grid_origin[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
};

typedef void (*emu_kernel_fn)(void** args, const emu_thread_info* t);
// Reduce `n` values spaced `stride` bytes apart into `out`.
typedef void (*emu_reduce_fn)(const unsigned char* values, int stride, int n, void* out);

}  // extern "C"

namespace {

constexpr int kSimdWidth = 32;
constexpr int kSlot = 64;  // bytes per lane in the exchange buffer (largest simd operand)
constexpr size_t kArenaCapacity = 1 << 20;
constexpr size_t kStackSize = 256 * 1024;
constexpr int kThreadsBarrierTimeoutSeconds = 60;

enum Backend { kFibers = 0, kThreads = 1 };

struct Launch;

struct BarrierState {
  int count = 0;
  unsigned gen = 0;
  int expected = 0;
  std::mutex mu;
  std::condition_variable cv;
};

struct SimdGroup {
  alignas(64) unsigned char buf[2][kSimdWidth * kSlot];
  unsigned char result[2][kSlot];
  BarrierState bar;
};

struct Lane;

// One threadgroup being run: its barriers, simdgroups and threadgroup memory.
struct Group {
  Launch* launch = nullptr;
  int nthreads = 0;
  uint32_t pos[3] = {0, 0, 0};
  std::vector<SimdGroup> simd;
  BarrierState tg_bar;
  std::mutex arena_mu;
  std::vector<std::pair<int, size_t>> vars;  // threadgroup variable id -> arena offset
  unsigned char* arena = nullptr;
  size_t used = 0;
  void** sched_sp = nullptr;  // fibers: the scheduler's saved stack pointer

  Group() : simd(), arena(static_cast<unsigned char*>(aligned_alloc(64, kArenaCapacity))) {}
  ~Group() { free(arena); }
};

// One GPU thread.
struct Lane {
  Group* group = nullptr;
  SimdGroup* sg = nullptr;
  int lane = 0;
  int lanes_in_sg = 0;
  int phase = 0;
  emu_thread_info info{};
  // fibers
  void* sp = nullptr;
  bool done = false;
  const unsigned* wait_gen_ptr = nullptr;
  unsigned wait_gen = 0;
  int waiting_on = 0;  // 1: threadgroup barrier, 2: simdgroup barrier
#if defined(ORCHARD_EMU_UCONTEXT)
  ucontext_t uctx;
#endif
};

struct Launch {
  emu_kernel_fn fn;
  void** args;
  uint32_t grid[3];
  uint32_t tg[3];
  uint32_t ntg[3];
  int backend;
  size_t tg_mem_limit;
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::string error;

  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> lk(err_mu);
    if (error.empty()) error = msg;
    failed.store(true);
  }
};

__attribute__((tls_model("initial-exec"))) thread_local Lane* tls_lane = nullptr;

// ---------------------------------------------------------------------------------
// Fibers: a minimal user-space context switch.
// ---------------------------------------------------------------------------------

#if !defined(ORCHARD_EMU_UCONTEXT)
extern "C" void orchard_emu_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .globl orchard_emu_ctx_switch
  .hidden orchard_emu_ctx_switch
  .type orchard_emu_ctx_switch,@function
orchard_emu_ctx_switch:
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
  .size orchard_emu_ctx_switch,.-orchard_emu_ctx_switch
  .popsection
)");
#endif

struct Stack {
  unsigned char* base = nullptr;
  size_t size = 0;
};

Stack make_stack() {
  Stack s;
  s.size = kStackSize;
  void* p = mmap(nullptr, s.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return s;
  mprotect(p, 4096, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
  s.base = static_cast<unsigned char*>(p);
  return s;
}

void free_stack(Stack& s) {
  if (s.base) munmap(s.base, s.size);
  s.base = nullptr;
}

[[noreturn]] void fiber_main();

#if !defined(ORCHARD_EMU_UCONTEXT)
void* init_fiber_stack(Stack& st) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(st.base) + st.size) & ~uintptr_t(15);
  uint64_t* slot = reinterpret_cast<uint64_t*>(top - 16);  // 16-aligned: the "return address"
  slot[0] = reinterpret_cast<uint64_t>(&fiber_main);
  slot[1] = 0;
  uint64_t* regs = slot - 6;  // r15 r14 r13 r12 rbx rbp
  for (int i = 0; i < 6; i++) regs[i] = 0;
  return regs;
}

inline void switch_to_fiber(Lane* l) { orchard_emu_ctx_switch(l->group->sched_sp, l->sp); }
inline void fiber_yield(Lane* l) { orchard_emu_ctx_switch(&l->sp, *l->group->sched_sp); }
#else
thread_local ucontext_t tls_sched_ctx;
void init_fiber_ctx(Lane* l, Stack& st) {
  getcontext(&l->uctx);
  l->uctx.uc_stack.ss_sp = st.base + 4096;
  l->uctx.uc_stack.ss_size = st.size - 4096;
  l->uctx.uc_link = nullptr;
  makecontext(&l->uctx, reinterpret_cast<void (*)()>(&fiber_main), 0);
}
inline void switch_to_fiber(Lane* l) { swapcontext(&tls_sched_ctx, &l->uctx); }
inline void fiber_yield(Lane* l) { swapcontext(&l->uctx, &tls_sched_ctx); }
#endif

[[noreturn]] void fiber_main() {
  Lane* l = tls_lane;
  Launch* L = l->group->launch;
  L->fn(L->args, &l->info);
  l->done = true;
  fiber_yield(l);
  __builtin_trap();  // a finished fiber is never resumed
}

// ---------------------------------------------------------------------------------
// Barriers
// ---------------------------------------------------------------------------------

// `on_last` runs once, in the last thread to arrive, before anyone is released.
template <typename F>
void barrier_wait(BarrierState& b, Lane* l, int kind, F&& on_last) {
  Launch* L = l->group->launch;
  if (L->backend == kFibers) {
    if (++b.count == b.expected) {
      on_last();
      b.count = 0;
      b.gen++;
      return;
    }
    l->wait_gen_ptr = &b.gen;
    l->wait_gen = b.gen;
    l->waiting_on = kind;
    fiber_yield(l);
    l->waiting_on = 0;
    return;
  }
  std::unique_lock<std::mutex> lk(b.mu);
  unsigned gen = b.gen;
  if (++b.count == b.expected) {
    on_last();
    b.count = 0;
    b.gen++;
    b.cv.notify_all();
    return;
  }
  while (b.gen == gen && !L->failed.load()) {
    if (b.cv.wait_for(lk, std::chrono::seconds(kThreadsBarrierTimeoutSeconds)) == std::cv_status::timeout &&
        b.gen == gen) {
      L->fail(std::string("deadlock: a ") + (kind == 1 ? "threadgroup barrier" : "simdgroup operation") +
              " was not reached by every thread within " + std::to_string(kThreadsBarrierTimeoutSeconds) + " s");
      b.cv.notify_all();
    }
  }
}

void reset_barrier(BarrierState& b, int expected) {
  b.count = 0;
  b.gen = 0;
  b.expected = expected;
}

// ---------------------------------------------------------------------------------
// Setting up and running threadgroups
// ---------------------------------------------------------------------------------

void tg_coords(const Launch& L, long index, uint32_t pos[3]) {
  pos[0] = uint32_t(index % L.ntg[0]);
  pos[1] = uint32_t((index / L.ntg[0]) % L.ntg[1]);
  pos[2] = uint32_t(index / (long(L.ntg[0]) * L.ntg[1]));
}

// Size of the threadgroup at `pos` (edge threadgroups of a non-uniform grid are smaller).
void tg_size(const Launch& L, const uint32_t pos[3], uint32_t size[3]) {
  for (int d = 0; d < 3; d++) {
    uint32_t start = pos[d] * L.tg[d];
    size[d] = std::min(L.tg[d], L.grid[d] - start);
  }
}

void prepare_group(Group& g, Launch& L, const uint32_t pos[3], std::vector<Lane>& lanes) {
  uint32_t size[3];
  tg_size(L, pos, size);
  int n = int(size[0] * size[1] * size[2]);
  int nominal = int(L.tg[0] * L.tg[1] * L.tg[2]);
  g.launch = &L;
  g.nthreads = n;
  for (int d = 0; d < 3; d++) g.pos[d] = pos[d];
  int nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  if (int(g.simd.size()) < nsimd) g.simd = std::vector<SimdGroup>(nsimd);
  for (int s = 0; s < nsimd; s++) reset_barrier(g.simd[s].bar, std::min(kSimdWidth, n - s * kSimdWidth));
  reset_barrier(g.tg_bar, n);
  g.vars.clear();
  g.used = 0;
  for (int i = 0; i < n; i++) {
    Lane& l = lanes[i];
    l.group = &g;
    l.sg = &g.simd[i / kSimdWidth];
    l.lane = i % kSimdWidth;
    l.lanes_in_sg = std::min(kSimdWidth, n - (i / kSimdWidth) * kSimdWidth);
    l.phase = 0;
    l.done = false;
    l.waiting_on = 0;
    l.wait_gen_ptr = nullptr;
    emu_thread_info& t = l.info;
    uint32_t local[3] = {uint32_t(i) % size[0], (uint32_t(i) / size[0]) % size[1], uint32_t(i) / (size[0] * size[1])};
    for (int d = 0; d < 3; d++) {
      t.thread_position_in_threadgroup[d] = local[d];
      t.threadgroup_position_in_grid[d] = pos[d];
      t.thread_position_in_grid[d] = pos[d] * L.tg[d] + local[d];
      t.threads_per_threadgroup[d] = size[d];
      t.dispatch_threads_per_threadgroup[d] = L.tg[d];
      t.threadgroups_per_grid[d] = L.ntg[d];
      t.threads_per_grid[d] = L.grid[d];
      t.grid_origin[d] = 0;
    }
    t.thread_index_in_threadgroup = uint32_t(i);
    t.simdgroup_index_in_threadgroup = uint32_t(i / kSimdWidth);
    t.thread_index_in_simdgroup = uint32_t(i % kSimdWidth);
    t.simdgroups_per_threadgroup = uint32_t(nsimd);
    t.dispatch_simdgroups_per_threadgroup = uint32_t((nominal + kSimdWidth - 1) / kSimdWidth);
    t.quadgroup_index_in_threadgroup = uint32_t(i / 4);
    t.thread_index_in_quadgroup = uint32_t(i % 4);
    t.quadgroups_per_threadgroup = uint32_t((n + 3) / 4);
    t.dispatch_quadgroups_per_threadgroup = uint32_t((nominal + 3) / 4);
    t.threads_per_simdgroup = kSimdWidth;
  }
}

std::string describe_tg(const Group& g) {
  char buf[96];
  snprintf(buf, sizeof buf, "threadgroup (%u, %u, %u)", g.pos[0], g.pos[1], g.pos[2]);
  return buf;
}

struct FiberWorker {
  Group group;
  std::vector<Lane> lanes;
  std::vector<Stack> stacks;
  void* sched_sp = nullptr;

  ~FiberWorker() {
    for (auto& s : stacks) free_stack(s);
  }
};

bool run_group_fibers(FiberWorker& w, Launch& L, long index) {
  uint32_t pos[3];
  tg_coords(L, index, pos);
  prepare_group(w.group, L, pos, w.lanes);
  Group& g = w.group;
  g.sched_sp = &w.sched_sp;
  int n = g.nthreads;
  for (int i = 0; i < n; i++) {
#if !defined(ORCHARD_EMU_UCONTEXT)
    w.lanes[i].sp = init_fiber_stack(w.stacks[i]);
#else
    init_fiber_ctx(&w.lanes[i], w.stacks[i]);
#endif
  }
  int live = n;
  while (live > 0) {
    bool progressed = false;
    // Simdgroups only meet at threadgroup barriers: run one simdgroup as far as it goes
    // before the next (32 stacks in the cache instead of the whole threadgroup's).
    for (int s0 = 0; s0 < n; s0 += kSimdWidth) {
      int s1 = std::min(n, s0 + kSimdWidth);
      for (bool any = true; any;) {
        any = false;
        for (int i = s0; i < s1; i++) {
          Lane& l = w.lanes[i];
          if (l.done) continue;
          if (l.waiting_on && *l.wait_gen_ptr == l.wait_gen) continue;
          tls_lane = &l;
          switch_to_fiber(&l);
          tls_lane = nullptr;
          any = progressed = true;
          if (l.done) live--;
        }
      }
    }
    if (live > 0 && !progressed) {
      int at_tg = 0, at_simd = 0, exited = 0;
      for (int i = 0; i < n; i++) {
        const Lane& l = w.lanes[i];
        if (l.done) exited++;
        else if (l.waiting_on == 1) at_tg++;
        else at_simd++;
      }
      L.fail("deadlock in " + describe_tg(g) + ": " + std::to_string(at_tg) + " threads wait at a threadgroup barrier, " +
             std::to_string(at_simd) + " at a simdgroup operation, " + std::to_string(exited) +
             " have returned (every thread must reach each threadgroup_barrier, and every lane of a simdgroup each "
             "simd operation)");
      return false;
    }
  }
  return true;
}

void run_fibers(Launch& L, int workers) {
  long total = long(L.ntg[0]) * L.ntg[1] * L.ntg[2];
  int nominal = int(L.tg[0] * L.tg[1] * L.tg[2]);
  if (workers < 1) workers = 1;
  if (long(workers) > total) workers = int(total);
  std::atomic<long> next{0};
  auto work = [&]() {
    FiberWorker w;
    w.lanes.resize(nominal);
    w.stacks.resize(nominal);
    for (auto& s : w.stacks) {
      s = make_stack();
      if (!s.base) {
        L.fail("could not allocate fiber stacks");
        return;
      }
    }
    for (long i; !L.failed.load() && (i = next.fetch_add(1)) < total;) {
      if (!run_group_fibers(w, L, i)) return;
    }
  };
  if (workers == 1) {
    work();
    return;
  }
  std::vector<std::thread> pool;
  for (int i = 0; i < workers; i++) pool.emplace_back(work);
  for (auto& t : pool) t.join();
}

// A reusable barrier for the OS threads of the threads backend (between threadgroups).
struct PoolBarrier {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  int expected = 0;
  unsigned gen = 0;
  void wait() {
    std::unique_lock<std::mutex> lk(mu);
    unsigned g = gen;
    if (++count == expected) {
      count = 0;
      gen++;
      cv.notify_all();
      return;
    }
    cv.wait(lk, [&] { return gen != g; });
  }
};

void run_threads(Launch& L) {
  long total = long(L.ntg[0]) * L.ntg[1] * L.ntg[2];
  int nominal = int(L.tg[0] * L.tg[1] * L.tg[2]);
  Group g;
  std::vector<Lane> lanes(nominal);
  PoolBarrier pool_bar;
  pool_bar.expected = nominal;
  auto body = [&](int t) {
    for (long i = 0; i < total; i++) {
      if (t == 0) {
        uint32_t pos[3];
        tg_coords(L, i, pos);
        prepare_group(g, L, pos, lanes);
      }
      pool_bar.wait();
      if (t < g.nthreads) {
        tls_lane = &lanes[t];
        L.fn(L.args, &lanes[t].info);
        tls_lane = nullptr;
      }
      pool_bar.wait();
      if (L.failed.load()) return;  // every thread sees the same flag after the barrier
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < nominal; t++) pool.emplace_back(body, t);
  for (auto& t : pool) t.join();
}

Lane* current(const char* what) {
  Lane* l = tls_lane;
  if (!l) {
    fprintf(stderr, "metal emulator: %s called outside a kernel\n", what);
    abort();
  }
  return l;
}

}  // namespace

extern "C" {

void emu_tg_barrier(void) {
  Lane* l = current("threadgroup_barrier");
  barrier_wait(l->group->tg_bar, l, 1, [] {});
}

void emu_simd_barrier(void) {
  Lane* l = current("simdgroup_barrier");
  barrier_wait(l->sg->bar, l, 2, [] {});
}

int emu_simd_lane_count(void) { return current("simd op")->lanes_in_sg; }
int emu_simd_lane_id(void) { return current("simd op")->lane; }

// All lanes contribute `size` bytes; every lane receives `fn` applied over the lanes in order.
void emu_simd_reduce(const void* mine, unsigned size, emu_reduce_fn fn, void* out) {
  Lane* l = current("simd reduction");
  SimdGroup& sg = *l->sg;
  int ph = l->phase;
  l->phase ^= 1;
  memcpy(sg.buf[ph] + l->lane * kSlot, mine, size);
  int n = l->lanes_in_sg;
  barrier_wait(sg.bar, l, 2, [&] { fn(sg.buf[ph], kSlot, n, sg.result[ph]); });
  memcpy(out, sg.result[ph], size);
}

// mode 0: from lane `arg`; 1: lane ^ arg; 2: lane + arg (own value past the end);
// 3: lane - arg (own value before 0); 4: (lane + arg) mod n; 5: (lane - arg) mod n.
void emu_simd_shuffle(const void* mine, unsigned size, int mode, int arg, void* out) {
  Lane* l = current("simd shuffle");
  SimdGroup& sg = *l->sg;
  int ph = l->phase;
  l->phase ^= 1;
  memcpy(sg.buf[ph] + l->lane * kSlot, mine, size);
  int n = l->lanes_in_sg;
  barrier_wait(sg.bar, l, 2, [] {});
  int src;
  switch (mode) {
    case 0: src = arg; break;
    case 1: src = l->lane ^ arg; break;
    case 2: src = l->lane + arg; break;
    case 3: src = l->lane - arg; break;
    case 4: src = ((l->lane + arg) % n + n) % n; break;
    default: src = ((l->lane - arg) % n + n) % n; break;
  }
  if (src < 0 || src >= n) src = l->lane;
  memcpy(out, sg.buf[ph] + src * kSlot, size);
}

// Every lane receives all lanes' values (`size` bytes each, packed); returns the lane count.
int emu_simd_gather(const void* mine, unsigned size, void* all) {
  Lane* l = current("simd gather");
  SimdGroup& sg = *l->sg;
  int ph = l->phase;
  l->phase ^= 1;
  memcpy(sg.buf[ph] + l->lane * kSlot, mine, size);
  int n = l->lanes_in_sg;
  barrier_wait(sg.bar, l, 2, [] {});
  for (int i = 0; i < n; i++) memcpy(static_cast<unsigned char*>(all) + i * size, sg.buf[ph] + i * kSlot, size);
  return n;
}

// Storage of the threadgroup variable `id` for the current threadgroup (same address for
// all its threads). Fresh memory is filled with 0xFF bytes (NaN for floats) because
// threadgroup memory starts uninitialised on the GPU.
void* emu_tg_var(int id, unsigned size, unsigned align) {
  Lane* l = current("threadgroup variable");
  Group& g = *l->group;
  std::lock_guard<std::mutex> lk(g.arena_mu);
  for (auto& v : g.vars)
    if (v.first == id) return g.arena + v.second;
  size_t off = (g.used + align - 1) / align * align;
  if (off + size > g.launch->tg_mem_limit || off + size > kArenaCapacity) {
    g.launch->fail("threadgroup memory: " + std::to_string(off + size) + " bytes exceed the limit of " +
                   std::to_string(g.launch->tg_mem_limit));
    off = 0;  // keep running on the arena; the launch reports the failure
    if (size > kArenaCapacity) abort();
  } else {
    g.used = off + size;
  }
  memset(g.arena + off, 0xFF, size);
  g.vars.emplace_back(id, off);
  return g.arena + off;
}

// Record a failure from kernel code (e.g. an unsupported operation).
void emu_fail(const char* msg) { current("emu_fail")->group->launch->fail(msg); }

int emu_launch(emu_kernel_fn fn, void** args, const uint32_t* grid, const uint32_t* tg, int backend, int workers,
               unsigned long tg_mem_limit, char* err, int errlen) {
  Launch L;
  L.fn = fn;
  L.args = args;
  L.backend = backend;
  L.tg_mem_limit = tg_mem_limit;
  for (int d = 0; d < 3; d++) {
    L.grid[d] = grid[d];
    L.tg[d] = tg[d];
    if (grid[d] == 0) return 0;
    if (tg[d] == 0) {
      snprintf(err, errlen, "threadgroup size must be positive");
      return 1;
    }
    L.ntg[d] = (grid[d] + tg[d] - 1) / tg[d];
  }
  if (backend == kThreads) run_threads(L);
  else run_fibers(L, workers);
  if (L.failed.load()) {
    snprintf(err, errlen, "%s", L.error.c_str());
    return 1;
  }
  return 0;
}

}  // extern "C"
