// llmc_sim_warp.h (part of llmc_sim.h): warp collectives. A shuffle, vote, reduce, __syncwarp, mma or
// ldmatrix is a barrier among the lanes of its mask: each lane parks at it (warp_op), and when every live lane
// of the mask waits at the same primitive, mask and call site (try_warp), the values are exchanged at once.
#pragma once

namespace llmc_sim {

// ---------------------------------------------------------------------------------------------------
// warp-level exchange
inline unsigned live_lanes(unsigned w) {
  unsigned m = 0;
  for (unsigned l = 0; l < 32; ++l) {
    unsigned i = 32 * w + l;
    if (i < g.nthreads && g.th[i].st != St::Exited) m |= 1u << l;
  }
  return m;
}

inline void exchange(unsigned w, unsigned group, Op op) {
  Thread* L = &g.th[32 * w];
  const Thread& first = L[__builtin_ctz(group)];
  switch (op) {
    case Op::Syncwarp: break;
    case Op::ShflIdx: case Op::ShflUp: case Op::ShflDown: case Op::ShflXor:
      for (unsigned l = 0; l < 32; ++l) {
        if (!(group >> l & 1)) continue;
        const int width = L[l].a1, v = L[l].a0;
        if (width < 1 || width > 32 || (width & (width - 1)))
          fatal("%s: width %d is not a power of two in 1..32 (%s:%d)", op_name(op), width, L[l].file, L[l].line);
        const unsigned base = l & ~static_cast<unsigned>(width - 1), end = base + width - 1;
        unsigned src = l;
        if (op == Op::ShflIdx) src = base + (static_cast<unsigned>(v) & 31u) % static_cast<unsigned>(width);
        else if (op == Op::ShflUp) { int s = static_cast<int>(l) - (v & 31); if (s >= static_cast<int>(base)) src = s; }
        else if (op == Op::ShflDown) { unsigned s = l + (v & 31); if (s <= end) src = s; }
        else { unsigned s = l ^ (v & 31); if (s <= end) src = s; }
        if (!(group >> src & 1))
          fatal("%s: lane %u reads lane %u, which is not in the mask 0x%08x or has exited (%s:%d)", op_name(op), l,
                src, L[l].mask, L[l].file, L[l].line);
        L[l].out = L[src].in;
      }
      return;
    default: break;
  }
  if (op == Op::Mma || op == Op::Ldmatrix) {
    if (group != 0xffffffffu)
      fatal("%s needs all 32 lanes of the warp (the warp has lanes 0x%08x alive) (%s:%d)", op_name(op), group,
            first.file, first.line);
    if (op == Op::Mma) do_mma(w); else do_ldmatrix(w);
    return;
  }
  if (op == Op::Syncwarp) return;
  uint64_t r = 0;
  bool init = false;
  for (unsigned l = 0; l < 32; ++l) {
    if (!(group >> l & 1)) continue;
    const uint64_t x = L[l].in;
    const uint32_t u = static_cast<uint32_t>(x);
    const int32_t s = static_cast<int32_t>(u);
    switch (op) {
      case Op::Ballot: r |= (x != 0 ? 1ull : 0ull) << l; break;
      case Op::Any: r |= (x != 0); break;
      case Op::All: r = (init ? r : 1) & (x != 0); break;
      case Op::ReduxAddU: r = static_cast<uint32_t>(r + u); break;
      case Op::ReduxMinU: r = init ? std::min<uint32_t>(static_cast<uint32_t>(r), u) : u; break;
      case Op::ReduxMaxU: r = init ? std::max<uint32_t>(static_cast<uint32_t>(r), u) : u; break;
      case Op::ReduxMinI: r = static_cast<uint32_t>(init ? std::min<int32_t>(static_cast<int32_t>(r), s) : s); break;
      case Op::ReduxMaxI: r = static_cast<uint32_t>(init ? std::max<int32_t>(static_cast<int32_t>(r), s) : s); break;
      case Op::ReduxAnd: r = init ? (r & u) : u; break;
      case Op::ReduxOr: r |= u; break;
      case Op::ReduxXor: r ^= u; break;
      default: fatal("internal: unknown warp op");
    }
    init = true;
  }
  for (unsigned l = 0; l < 32; ++l)
    if (group >> l & 1) L[l].out = r;
}

// Completes every group of lanes of warp w whose lanes have all arrived at the same primitive (op, mask and
// call site). A group whose lanes wait at different primitives stays blocked; if nothing else can run, that
// is reported as a deadlock.
inline void try_warp(unsigned w) {
  const unsigned live = live_lanes(w);
  unsigned waiting = 0;
  for (unsigned l = 0; l < 32; ++l) {
    unsigned i = 32 * w + l;
    if (i < g.nthreads && g.th[i].st == St::Warp) waiting |= 1u << l;
  }
  unsigned todo = waiting;
  while (todo) {
    const unsigned l0 = static_cast<unsigned>(__builtin_ctz(todo));
    todo &= todo - 1;
    const Thread& t0 = g.th[32 * w + l0];
    if (!(t0.mask >> l0 & 1))
      fatal("%s: lane %u calls it with mask 0x%08x, which does not include the lane itself (%s:%d)", op_name(t0.op),
            l0, t0.mask, t0.file, t0.line);
    const unsigned group = t0.mask & live;
    if (group & ~waiting) continue;  // lanes still running, or stuck elsewhere (see deadlock)
    bool same = true;
    for (unsigned l = 0; l < 32 && same; ++l) {
      const Thread& t = g.th[32 * w + l];
      same = !(group >> l & 1) || (t.op == t0.op && t.mask == t0.mask && same_site(t, t0));
    }
    if (!same) continue;
    exchange(w, group, t0.op);
    waiting &= ~group;
    todo &= ~group;
    for (unsigned l = 0; l < 32; ++l)
      if (group >> l & 1) {
        g.th[32 * w + l].st = St::Runnable;
        g.runnable.push_back(static_cast<int>(32 * w + l));
      }
  }
}

inline uint64_t warp_op(Op op, unsigned mask, uint64_t in, int a0, int a1, const char* file, int line) {
  Thread& t = self();
  t.op = op;
  t.mask = mask;
  t.in = in;
  t.a0 = a0;
  t.a1 = a1;
  t.file = file;
  t.line = line;
  t.st = St::Warp;
  to_scheduler();
  t.op = Op::None;
  return t.out;
}

template <class T>
inline T shfl(Op op, unsigned mask, T var, int v, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");  // __half2 & co. are not trivially copyable
  uint64_t in = 0;
  std::memcpy(&in, &var, sizeof(T));
  uint64_t out = warp_op(op, mask, in, v, width, file, line);
  T r;
  std::memcpy(&r, &out, sizeof(T));
  return r;
}

}  // namespace llmc_sim

// ---------------------------------------------------------------------------------------------------
// the intrinsics (each records its call site, LLMC_SIM_SITE)
inline void __syncwarp(unsigned mask = 0xffffffffu, LLMC_SIM_SITE) {
  llmc_sim::warp_op(llmc_sim::Op::Syncwarp, mask, 0, 0, 32, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflIdx, mask, var, srcLane, width, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflUp, mask, var, static_cast<int>(delta), width, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflDown, mask, var, static_cast<int>(delta), width, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflXor, mask, var, laneMask, width, llmc_file_, llmc_line_);
}
inline unsigned __ballot_sync(unsigned mask, int pred, LLMC_SIM_SITE) {
  return static_cast<unsigned>(llmc_sim::warp_op(llmc_sim::Op::Ballot, mask, pred != 0, 0, 32, llmc_file_, llmc_line_));
}
inline int __any_sync(unsigned mask, int pred, LLMC_SIM_SITE) {
  return static_cast<int>(llmc_sim::warp_op(llmc_sim::Op::Any, mask, pred != 0, 0, 32, llmc_file_, llmc_line_));
}
inline int __all_sync(unsigned mask, int pred, LLMC_SIM_SITE) {
  return static_cast<int>(llmc_sim::warp_op(llmc_sim::Op::All, mask, pred != 0, 0, 32, llmc_file_, llmc_line_));
}
inline unsigned __activemask() {
  llmc_sim::self();
  return llmc_sim::live_lanes(static_cast<unsigned>(llmc_sim::g.cur) / 32);
}
#define LLMC_SIM_REDUX(name, T, op)                                                                       \
  inline T name(unsigned mask, T value, LLMC_SIM_SITE) {                                                  \
    return static_cast<T>(llmc_sim::warp_op(llmc_sim::Op::op, mask, static_cast<uint32_t>(value), 0, 32, \
                                            llmc_file_, llmc_line_));                                     \
  }
LLMC_SIM_REDUX(__reduce_add_sync, unsigned, ReduxAddU)
LLMC_SIM_REDUX(__reduce_add_sync, int, ReduxAddU)
LLMC_SIM_REDUX(__reduce_min_sync, unsigned, ReduxMinU)
LLMC_SIM_REDUX(__reduce_min_sync, int, ReduxMinI)
LLMC_SIM_REDUX(__reduce_max_sync, unsigned, ReduxMaxU)
LLMC_SIM_REDUX(__reduce_max_sync, int, ReduxMaxI)
LLMC_SIM_REDUX(__reduce_and_sync, unsigned, ReduxAnd)
LLMC_SIM_REDUX(__reduce_or_sync, unsigned, ReduxOr)
LLMC_SIM_REDUX(__reduce_xor_sync, unsigned, ReduxXor)
#undef LLMC_SIM_REDUX
