// llmc_sim_profile.h (part of llmc_sim.h): the simulator's counters for `llmc profile --simulate`.
//
// Only a build with -DLLMC_SIM_PROFILE counts (compiler/codegen/simulator.py build_profiled_library); in every
// other build the hooks below are empty and this file adds nothing. That build compiles the kernels with
// -fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0, so every load and store of
// kernel code calls __asan_{load,store}{1,2,4,8,16,N}_noabort(addr); a second translation unit, built without
// the flag, defines them (LLMC_SIM_PROFILE_IMPL below). GCC treats those calls as leaf functions, so the host
// reads the counters through llmc_sim_prof_* functions of that same unit.
//
// What is counted, per kernel (the demangled name of the __global__ function), while counting is enabled:
// - An access is global when its address lies in a cudaMalloc'ed block (or a kernel's LLMC_DEVICE_ARRAY), shared when it lies in the dynamic
//   shared-memory buffer or in a static __shared__ variable: a section of its own in this build, or, for
//   the statics of inline and template functions (every templated kernel's), whose COMDAT sections GCC
//   keeps in spite of the section attribute, a function-local static of this library by its symbol
//   (mangled "_ZZ...", found once by dladdr1). Anything else (fiber stacks, the simulator's own state, host
//   memory) is not counted. The simulator's internals
//   that move data for a kernel (cp.async, ldmatrix, mma) are not instrumented and count themselves.
// - A warp-wide access is the k-th execution of one access site (call site of the hook) by the lanes of one
//   warp of a block; it is complete when every lane of the warp has made it, or when the block ends.
// - requested_bytes: the bytes the lanes asked for (loads + stores; cp.async counts its source read).
// - dram_bytes: 32 bytes per distinct sector loaded plus 32 per distinct sector stored, distinct within one
//   launch (an L2 that holds the launch's working set: a weight sector read by several warps counts once);
//   summed over launches.
// - sector_efficiency = sum over warp-wide global accesses of the distinct bytes they ask for / the sum of
//   the bytes of the sectors each touches (so 1.0 for a coalesced access, 1/8 for 4 bytes out of every 32).
// - floor_bytes: distinct bytes loaded plus distinct bytes stored per launch, summed over launches: the
//   bytes the kernel must move if it reads and writes each byte it uses once.
// - Shared memory: requests = warp-wide shared accesses (ldmatrix: one per instruction); a request's
//   passes = max over the 32 banks of the distinct 4-byte words it touches in that bank (one word read by
//   many lanes is a broadcast), its ideal = ceil(distinct words / 32) (ldmatrix: one per 8x8 matrix);
//   bank_conflicts = sum of (passes - ideal): the replays, as nvprof's shared_*_transactions_per_request - 1.
//   Banks are taken from the host address mod 128 (the dynamic buffer is 128-byte aligned).
// - mma: mma.sync m16n8k16 instructions, one per warp; tensor_flops = 2*16*8*16 per instruction. SIMT
//   arithmetic is not counted.
// - blocks: the blocks that stored to global memory. A grid is sized from host-side bounds (paged attention's
//   from B x the block table's width), and a block that found no work stores nothing: it does not count
//   toward the SMs a launch keeps busy.
#pragma once

#if defined(LLMC_SIM_PROFILE_IMPL)
#include <cxxabi.h>
#include <dlfcn.h>
#include <link.h>

#include <cstring>

#include <map>
#include <string>
#include <unordered_set>

extern "C" char __start_llmc_sim_smem[] __attribute__((weak));
extern "C" char __stop_llmc_sim_smem[] __attribute__((weak));

namespace llmc_sim_prof {

enum Field {
  kLaunches, kRequested, kDramBytes, kFloorBytes, kUsefulBytes, kFetchedBytes, kGlobalRequests,
  kSharedRequests, kBankConflicts, kMma, kTensorFlops, kBlocks, kNumFields
};

struct Kernel {
  std::string name;
  uint64_t v[kNumFields] = {};
};

struct Alloc {
  size_t size = 0;
  bool touched = false;
  std::vector<uint64_t> bits[4];  // load sectors, store sectors, load bytes, store bytes (this launch)
};

struct Lane {
  uintptr_t addr;
  uint32_t size;
};
struct Group {
  unsigned arrivals = 0;
  bool shared = false;
  std::vector<Lane> lanes;
};
struct Key {
  unsigned warp;
  uintptr_t site;
  uint32_t k;
  bool store;
  bool operator==(const Key& o) const { return warp == o.warp && site == o.site && k == o.k && store == o.store; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<uintptr_t>()(k.site) ^ (static_cast<size_t>(k.warp) * 0x9E3779B97F4A7C15ull) ^
           (static_cast<size_t>(k.k) << 20) ^ k.store;
  }
};

struct State {
  bool enabled = false;
  std::map<uintptr_t, Alloc> allocs;
  std::vector<Kernel> kernels;
  std::unordered_map<const void*, size_t> index;
  Kernel* cur = nullptr;
  std::vector<std::unordered_map<uintptr_t, uint32_t>> site_count;  // per thread of the block
  std::unordered_map<Key, Group, KeyHash> open;
  std::vector<uintptr_t> scratch;
  bool block_stored = false;  // the running block has stored to global memory
  // symbols of this library's data looked up so far: start -> (size, a function-local static)
  std::map<uintptr_t, std::pair<size_t, bool>> symbols;
  // 4 KB pages that no loaded object maps (fiber stacks, the heap): not a static, and no dladdr1 again. A kernel
  // whose struct arguments live on its fibers' stacks reads them on every access (an expert GEMM's row list:
  // a simulated MoE layer took minutes in dladdr1 alone).
  std::unordered_set<uintptr_t> foreign_pages;
};
inline State s;

inline std::string kernel_name(const void* kernel) {
  Dl_info info{};
  if (dladdr(kernel, &info) && info.dli_sname) {
    int status = 0;
    char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    std::string name = status == 0 && d ? d : info.dli_sname;
    std::free(d);
    const size_t paren = name.find('(');  // the parameter list adds nothing to a template's name
    return paren == std::string::npos ? name : name.substr(0, paren);
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "kernel@%p", kernel);
  return buf;
}

inline Alloc* alloc_of(uintptr_t a, uintptr_t* base) {
  auto it = s.allocs.upper_bound(a);
  if (it == s.allocs.begin()) return nullptr;
  --it;
  if (a >= it->first + it->second.size) return nullptr;
  *base = it->first;
  return &it->second;
}

// A function-local static of this library's data (a templated kernel's __shared__), by its symbol.
inline bool is_local_static(uintptr_t a) {
  auto it = s.symbols.upper_bound(a);
  if (it != s.symbols.begin() && a < std::prev(it)->first + std::prev(it)->second.first)
    return std::prev(it)->second.second;
  if (s.foreign_pages.count(a >> 12)) return false;
  Dl_info info{};
  ElfW(Sym)* sym = nullptr;
  if (!dladdr1(reinterpret_cast<void*>(a), &info, reinterpret_cast<void**>(&sym), RTLD_DL_SYMENT)) {
    s.foreign_pages.insert(a >> 12);
    return false;
  }
  if (!sym || !info.dli_sname || !info.dli_saddr) return false;
  const uintptr_t start = reinterpret_cast<uintptr_t>(info.dli_saddr);
  if (sym->st_size == 0 || a >= start + sym->st_size) return false;  // past the symbol: a stack or the heap
  const bool local = std::strncmp(info.dli_sname, "_ZZ", 3) == 0;
  s.symbols[start] = {sym->st_size, local};
  return local;
}

inline bool is_shared(uintptr_t a) {
  const auto& g = llmc_sim::g;
  const uintptr_t d = reinterpret_cast<uintptr_t>(g.dyn_smem);
  if (d && a >= d && a < d + g.dyn_smem_bytes) return true;
  if (__start_llmc_sim_smem && a >= reinterpret_cast<uintptr_t>(__start_llmc_sim_smem) &&
      a < reinterpret_cast<uintptr_t>(__stop_llmc_sim_smem))
    return true;
  return is_local_static(a);
}

// sets bit i; true if it was clear
inline bool mark(std::vector<uint64_t>& bits, size_t n, size_t i) {
  if (bits.empty()) bits.assign((n + 63) / 64, 0);
  uint64_t& w = bits[i / 64];
  const uint64_t m = 1ull << (i % 64);
  if (w & m) return false;
  w |= m;
  return true;
}

inline void finish_global(const Group& grp, bool store) {
  Kernel& k = *s.cur;
  std::vector<uintptr_t>& sec = s.scratch;
  sec.clear();
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ranges.reserve(grp.lanes.size());
  for (const Lane& l : grp.lanes) {
    k.v[kRequested] += l.size;
    ranges.emplace_back(l.addr, l.addr + l.size);
    for (uintptr_t x = l.addr >> 5; x <= (l.addr + l.size - 1) >> 5; ++x) sec.push_back(x);
  }
  std::sort(ranges.begin(), ranges.end());
  uintptr_t end = 0;
  for (auto& [b, e] : ranges) {  // union of the lanes' bytes: what the warp asks for, broadcasts once
    const uintptr_t from = std::max(b, end);
    if (e > from) k.v[kUsefulBytes] += e - from;
    end = std::max(end, e);
  }
  std::sort(sec.begin(), sec.end());
  sec.erase(std::unique(sec.begin(), sec.end()), sec.end());
  k.v[kFetchedBytes] += 32 * sec.size();
  k.v[kGlobalRequests] += 1;
  for (uintptr_t x : sec) {  // cudaMalloc blocks are 256-byte aligned: a sector lies in one block
    uintptr_t base = 0;
    Alloc* a = alloc_of(x << 5, &base);
    if (!a) continue;
    a->touched = true;
    if (mark(a->bits[store ? 1 : 0], (a->size + 31) / 32, x - (base >> 5))) k.v[kDramBytes] += 32;
  }
  for (const Lane& l : grp.lanes) {
    uintptr_t base = 0;
    Alloc* a = alloc_of(l.addr, &base);
    if (!a) continue;
    a->touched = true;
    for (uintptr_t b = l.addr; b < l.addr + l.size && b < base + a->size; ++b)
      if (mark(a->bits[store ? 3 : 2], a->size, b - base)) k.v[kFloorBytes] += 1;
  }
}

// passes of one shared request over the words it touches, minus the ideal number
inline uint64_t bank_replays(std::vector<uintptr_t>& words) {
  std::sort(words.begin(), words.end());
  words.erase(std::unique(words.begin(), words.end()), words.end());
  unsigned per_bank[32] = {};
  unsigned worst = 0;
  for (uintptr_t w : words) worst = std::max(worst, ++per_bank[w & 31]);
  const uint64_t ideal = (words.size() + 31) / 32;
  return worst > ideal ? worst - ideal : 0;
}

inline void finish(const Key& key, const Group& grp) {
  if (!grp.shared) return finish_global(grp, key.store);
  std::vector<uintptr_t>& words = s.scratch;
  words.clear();
  for (const Lane& l : grp.lanes)
    for (uintptr_t w = l.addr >> 2; w <= (l.addr + l.size - 1) >> 2; ++w) words.push_back(w);
  s.cur->v[kSharedRequests] += 1;
  s.cur->v[kBankConflicts] += bank_replays(words);
}

inline bool counting() { return s.enabled && s.cur && llmc_sim::g.in_kernel && llmc_sim::g.cur >= 0; }

inline void access(uintptr_t a, size_t n, bool store, uintptr_t site) {
  if (!counting() || n == 0) return;
  const bool shared = is_shared(a);
  uintptr_t base = 0;
  if (!shared && !alloc_of(a, &base)) return;
  if (store && !shared) s.block_stored = true;
  const unsigned t = static_cast<unsigned>(llmc_sim::g.cur);
  const uint32_t k = s.site_count[t][site]++;
  const Key key{t / 32, site, k, store};
  Group& grp = s.open[key];
  grp.shared = shared;
  grp.lanes.push_back(Lane{a, static_cast<uint32_t>(n)});
  const unsigned lanes = std::min(32u, llmc_sim::g.nthreads - 32 * (t / 32));
  if (++grp.arrivals == lanes) {
    finish(key, grp);
    s.open.erase(key);
  }
}

}  // namespace llmc_sim_prof

extern "C" {
void llmc_sim_prof_launch_begin(const void* kernel) {
  using namespace llmc_sim_prof;
  auto it = s.index.find(kernel);
  if (it == s.index.end()) {
    it = s.index.emplace(kernel, s.kernels.size()).first;
    s.kernels.push_back(Kernel{kernel_name(kernel), {}});
  }
  s.cur = &s.kernels[it->second];
  if (s.enabled) s.cur->v[kLaunches] += 1;
}
void llmc_sim_prof_launch_end() {
  using namespace llmc_sim_prof;
  for (auto& [base, a] : s.allocs)
    if (a.touched) {
      for (auto& b : a.bits) std::fill(b.begin(), b.end(), 0);
      a.touched = false;
    }
  s.cur = nullptr;
}
void llmc_sim_prof_block_begin() {
  using namespace llmc_sim_prof;
  s.block_stored = false;
  s.site_count.assign(llmc_sim::g.nthreads, {});
  s.open.clear();
}
void llmc_sim_prof_block_end() {
  using namespace llmc_sim_prof;
  if (s.cur && s.enabled) {
    for (auto& [key, grp] : s.open) finish(key, grp);  // warps whose lanes did not all make the access
    if (s.block_stored) s.cur->v[kBlocks] += 1;
  }
  s.open.clear();
}
void llmc_sim_prof_alloc(const void* p, size_t n) {
  if (p && n) llmc_sim_prof::s.allocs[reinterpret_cast<uintptr_t>(p)].size = n;
}
void llmc_sim_prof_free(const void* p) { llmc_sim_prof::s.allocs.erase(reinterpret_cast<uintptr_t>(p)); }
void llmc_sim_prof_mma() {
  using namespace llmc_sim_prof;
  if (!s.enabled || !s.cur) return;
  s.cur->v[kMma] += 1;
  s.cur->v[kTensorFlops] += 2 * 16 * 8 * 16;
}
void llmc_sim_prof_ldmatrix(const void* const* rows, int num) {
  using namespace llmc_sim_prof;
  if (!s.enabled || !s.cur) return;
  uint64_t replays = 0;
  for (int j = 0; j < num; ++j) {  // one 8x8 matrix (eight 16-byte rows) is one pass when conflict-free
    std::vector<uintptr_t>& words = s.scratch;
    words.clear();
    for (int r = 0; r < 8; ++r)
      for (int w = 0; w < 4; ++w) words.push_back((reinterpret_cast<uintptr_t>(rows[8 * j + r]) >> 2) + w);
    replays += bank_replays(words);
  }
  s.cur->v[kSharedRequests] += 1;
  s.cur->v[kBankConflicts] += replays;
}
void llmc_sim_prof_access(const void* addr, size_t n, int store, const void* site) {
  llmc_sim_prof::access(reinterpret_cast<uintptr_t>(addr), n, store != 0, reinterpret_cast<uintptr_t>(site));
}

// the host's side (ctypes): enable/disable counting, clear, and read one kernel's counters
__attribute__((visibility("default"))) void llmc_sim_prof_enable(int on) { llmc_sim_prof::s.enabled = on != 0; }
__attribute__((visibility("default"))) void llmc_sim_prof_clear() {
  for (auto& k : llmc_sim_prof::s.kernels) std::fill(std::begin(k.v), std::end(k.v), 0);
  llmc_sim_prof::s.foreign_pages.clear();
}
__attribute__((visibility("default"))) int llmc_sim_prof_num_kernels() {
  return static_cast<int>(llmc_sim_prof::s.kernels.size());
}
__attribute__((visibility("default"))) int llmc_sim_prof_num_fields() { return llmc_sim_prof::kNumFields; }
// kernel i: its name into name[0..len) (NUL-terminated, cut to fit) and its counters into out[kNumFields]
__attribute__((visibility("default"))) int llmc_sim_prof_kernel(int i, char* name, int len, uint64_t* out) {
  using namespace llmc_sim_prof;
  if (i < 0 || static_cast<size_t>(i) >= s.kernels.size() || len < 1) return 1;
  const Kernel& k = s.kernels[static_cast<size_t>(i)];
  std::snprintf(name, static_cast<size_t>(len), "%s", k.name.c_str());
  std::copy(std::begin(k.v), std::end(k.v), out);
  return 0;
}

#define LLMC_SIM_PROF_HOOKS(N)                                                                             \
  void __asan_load##N##_noabort(void* p) {                                                                 \
    llmc_sim_prof::access(reinterpret_cast<uintptr_t>(p), N, false,                                        \
                          reinterpret_cast<uintptr_t>(__builtin_return_address(0)));                        \
  }                                                                                                        \
  void __asan_store##N##_noabort(void* p) {                                                                \
    llmc_sim_prof::access(reinterpret_cast<uintptr_t>(p), N, true,                                         \
                          reinterpret_cast<uintptr_t>(__builtin_return_address(0)));                        \
  }
LLMC_SIM_PROF_HOOKS(1)
LLMC_SIM_PROF_HOOKS(2)
LLMC_SIM_PROF_HOOKS(4)
LLMC_SIM_PROF_HOOKS(8)
LLMC_SIM_PROF_HOOKS(16)
#undef LLMC_SIM_PROF_HOOKS
// the rest of what kernel-address code calls: nothing to check here
void __asan_handle_no_return() {}
void __asan_before_dynamic_init(const char*) {}
void __asan_after_dynamic_init() {}
void __asan_loadN_noabort(void* p, size_t n) {
  llmc_sim_prof::access(reinterpret_cast<uintptr_t>(p), n, false,
                        reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
void __asan_storeN_noabort(void* p, size_t n) {
  llmc_sim_prof::access(reinterpret_cast<uintptr_t>(p), n, true,
                        reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
}
#endif
