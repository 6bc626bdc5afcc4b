// The emulator's runtime: runs a kernel's grid on the calling OS thread with CUDA's
// execution semantics. Compiled once per machine into a shared library (see build.py);
// every kernel module links against it.
//
// Blocks run one after another. The threads of a block are fibers: each runs until it
// reaches a barrier or a warp-level operation, or returns, and then hands control back to
// the scheduler, which resumes the runnable fibers in a fixed order (ascending thread index,
// or descending on request) in sweeps:
//   - __syncthreads() releases when every thread that has not returned has arrived;
//   - a warp operation completes when every lane its mask names has arrived at the same
//     operation with the same mask, or has returned;
//   - a sweep in which nothing can run is a deadlock, reported with what each thread waits for.
// Shared memory is the module's thread-local storage (cuda_emu.h), filled with 0xff bytes (NaN
// in every float width) before each block. Faults (segmentation, bus, arithmetic errors) in a
// kernel end the launch with an error naming the thread instead of killing the process.
#include "emu_abi.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) || defined(EMU_UCONTEXT)
#include <ucontext.h>
#endif

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

enum FiberState : unsigned char { RUNNABLE, AT_BARRIER, AT_WARP, RETURNED };

// What a thread's stack slot holds besides its stack (see emu_abi.h); `pub` must come first.
struct Slot {
    emu_thread pub;
    void* sp;  // saved stack pointer while switched out
};
static_assert(sizeof(Slot) <= kEmuThreadBytes, "the descriptor must fit its place in the slot");

// The lanes of a warp and what each asked for in a warp operation. Kept together, apart
// from the stacks, so that a rendezvous reads one small structure and not 32 stack slots.
struct Warp {
    unsigned returned;  // lanes that returned, or that do not exist (a partial last warp)
    unsigned waiting;   // lanes waiting in a warp operation
    unsigned mask[32];
    int op[32], arg[32], width[32];
    std::uint64_t value[32], result[32];
    // a warp-wide .aligned instruction: its name and call site, what each lane hands in, where
    // each lane takes everyone's
    const char* what[32];
    const char* file[32];
    int line[32], bytes[32];
    const void* in[32];
    void* out[32];
};

// A cp.async in flight: the bytes it read at issue, written to `dst` by the wait that covers it.
struct AsyncCopy {
    unsigned char* dst;
    int bytes, src_bytes;
    unsigned char data[16];
};

// A thread's cp.async copies: those not yet committed, and the committed groups, oldest first.
struct AsyncCopies {
    std::vector<AsyncCopy> open;
    std::vector<std::vector<AsyncCopy>> groups;
    std::size_t pending() const {
        std::size_t n = open.size();
        for (const auto& group : groups) n += group.size();
        return n;
    }
};

struct Module {
    void* handle;
    void* (*dynamic_shared)();  // this OS thread's dynamic shared memory buffer
    std::size_t tls_bytes;       // the module's thread-local block: all of its shared memory
};

// The canary after the dynamic shared memory a launch asked for.
constexpr unsigned char kSharedTail = 0xa5;

struct Launch {
    void (*entry)(void**);
    void** args;
    dim3 grid, block;
    uint3 block_idx;
    int threads;
    bool descending;
    int live, at_barrier;
    int barrier_sum, barrier_and, barrier_or;
    std::vector<unsigned char> state;   // FiberState of each thread
    std::vector<unsigned char> how;     // what each thread at the barrier reduces (0 count, 1 and, 2 or)
    std::vector<int> barrier_result;
    std::vector<Warp> warps;
    int current;  // the running thread, or -1 in the scheduler
    void* scheduler_sp;
    bool failed;
    std::string error;
    // shared memory of this OS thread's copy of the module
    unsigned char* tls;
    std::size_t tls_bytes;
    unsigned char* dynamic;
    std::size_t dynamic_bytes;
    // the kernel's argument buffers, [start, end): the global memory a cp.async may read
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> regions;
    std::vector<AsyncCopies> async;  // of each thread
};

Launch* g_launch = nullptr;
std::mutex g_launch_mutex;

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

// ---- stack slots -------------------------------------------------------------------------------
// One slot per thread of the largest block seen, reserved once and reused by every launch:
// [guard page | stack ... | descriptor], so that a thread's descriptor and the top of its
// stack share a page.
struct SlotPool {
    unsigned char* base = nullptr;
    int count = 0;

    unsigned char* slot_base(int i) const { return base + std::size_t(i) * kEmuSlotBytes; }
    Slot* slot(int i) const { return reinterpret_cast<Slot*>(slot_base(i) + kEmuThreadOffset); }
    unsigned char* stack_top(int i) const { return slot_base(i) + kEmuThreadOffset; }
    unsigned char* guard(int i) const { return slot_base(i); }

    bool reserve(int n) {
        if (n <= count) return true;
        if (base) munmap(base - alignment_waste, std::size_t(count) * kEmuSlotBytes + kEmuSlotBytes);
        // Over-allocate by one slot to align the first slot to kEmuSlotBytes.
        const std::size_t bytes = std::size_t(n) * kEmuSlotBytes + kEmuSlotBytes;
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED) {
            base = nullptr;
            count = 0;
            return false;
        }
        const std::uintptr_t raw = reinterpret_cast<std::uintptr_t>(p);
        const std::uintptr_t aligned = (raw + kEmuSlotBytes - 1) & ~(kEmuSlotBytes - 1);
        alignment_waste = aligned - raw;
        base = reinterpret_cast<unsigned char*>(aligned);
        count = n;
        for (int i = 0; i < n; ++i) mprotect(guard(i), kEmuPageBytes, PROT_NONE);
        return true;
    }

  private:
    std::size_t alignment_waste = 0;
};

SlotPool g_slots;

std::string describe_thread(int i) {
    const emu_thread& t = g_slots.slot(i)->pub;
    return format("thread (%u,%u,%u) of block (%u,%u,%u)", t.thread_idx.x, t.thread_idx.y, t.thread_idx.z,
                  t.block_idx.x, t.block_idx.y, t.block_idx.z);
}

// ---- context switch ----------------------------------------------------------------------------
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
// A switch saves the callee-saved registers on the old stack and restores them from the new
// one: no system call (swapcontext makes one per switch to save the signal mask).
extern "C" void emu_switch_stack(void** save_sp, void* next_sp);
extern "C" void emu_fiber_trampoline();
asm(R"(
    .text
    .p2align 4
    .type emu_switch_stack, @function
emu_switch_stack:
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
    .size emu_switch_stack, .-emu_switch_stack

    .p2align 4
    .type emu_fiber_trampoline, @function
emu_fiber_trampoline:
    .cfi_startproc
    .cfi_undefined rip
    movq %rbx, %rdi
    call emu_fiber_main
    ud2
    .cfi_endproc
    .size emu_fiber_trampoline, .-emu_fiber_trampoline
)");

void prepare_fiber(int i) {
    // Six callee-saved registers, then the return address of the first switch: the
    // trampoline, which calls emu_fiber_main(rbx) with the stack 16-byte aligned.
    // After the six pops and the ret, the stack pointer is `aligned`.
    const auto top = reinterpret_cast<std::uintptr_t>(g_slots.stack_top(i));
    const std::uintptr_t aligned = (top & ~std::uintptr_t(15)) - 16;
    auto* words = reinterpret_cast<std::uintptr_t*>(aligned - 7 * sizeof(std::uintptr_t));
    for (int k = 0; k < 6; ++k) words[k] = 0;
    words[4] = std::uintptr_t(i);  // rbx
    words[6] = reinterpret_cast<std::uintptr_t>(&emu_fiber_trampoline);
    g_slots.slot(i)->sp = words;
}

inline void switch_to_fiber(int i) { emu_switch_stack(&g_launch->scheduler_sp, g_slots.slot(i)->sp); }
inline void switch_to_scheduler(int i) { emu_switch_stack(&g_slots.slot(i)->sp, g_launch->scheduler_sp); }
#else
// Portable fallback: ucontext (one system call per switch).
ucontext_t g_scheduler_context;
std::vector<ucontext_t> g_contexts;

extern "C" __attribute__((visibility("hidden"))) void emu_fiber_main(std::uintptr_t i);
void fiber_start(int i) { emu_fiber_main(std::uintptr_t(i)); }

void prepare_fiber(int i) {
    if (g_contexts.size() < std::size_t(g_slots.count)) g_contexts.resize(g_slots.count);
    ucontext_t& c = g_contexts[i];
    getcontext(&c);
    unsigned char* bottom = g_slots.guard(i) + kEmuPageBytes;
    c.uc_stack.ss_sp = bottom;
    c.uc_stack.ss_size = std::size_t(g_slots.stack_top(i) - bottom);
    c.uc_link = nullptr;
    makecontext(&c, reinterpret_cast<void (*)()>(&fiber_start), 1, i);
}

inline void switch_to_fiber(int i) { swapcontext(&g_scheduler_context, &g_contexts[i]); }
inline void switch_to_scheduler(int i) { swapcontext(&g_contexts[i], &g_scheduler_context); }
#endif

// ---- failures ----------------------------------------------------------------------------------
void fail(std::string message) {
    if (!g_launch->failed) {
        g_launch->failed = true;
        g_launch->error = std::move(message);
    }
}

// Ends the running thread's part in the launch: the scheduler sees `failed` and stops.
[[noreturn]] void fail_in_fiber(const std::string& message) {
    const int i = g_launch->current;
    fail(describe_thread(i) + ": " + message);
    switch_to_scheduler(i);
    std::abort();  // a failed launch never resumes its fibers
}

// ---- warps -------------------------------------------------------------------------------------
const char* warp_op_name(int op) {
    static const char* const names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                        "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp", "an .aligned instruction"};
    return names[op];
}

// What a lane waits in, for a message: the operation, and for an .aligned one its call site.
std::string waits_in(const Warp& w, int lane) {
    if (w.op[lane] != EMU_ALIGNED) return format("%s(mask 0x%08x)", warp_op_name(w.op[lane]), w.mask[lane]);
    return format("%s at %s:%d", w.what[lane], w.file[lane], w.line[lane]);
}

// A lane's result under PTX's shfl.sync rules: CUDA's width w becomes the segment mask
// 32 - w, the source lane or offset is taken modulo 32, and a source outside the lane's
// segment yields the lane's own value. Reading a lane that does not take part is undefined
// on a GPU; here it yields all one bits (NaN for floats) so that it shows.
std::uint64_t shuffle_result(const Warp& w, unsigned group, int lane) {
    const int segmask = 32 - w.width[lane];
    const int b = w.arg[lane] & 31;
    const int low = lane & segmask;
    const int high = low | (31 & ~segmask);
    int src = lane;
    bool inside = true;
    switch (w.op[lane]) {
        case EMU_SHFL_IDX: src = low | (b & ~segmask); break;
        case EMU_SHFL_UP: src = lane - b; inside = src >= low; break;
        case EMU_SHFL_DOWN: src = lane + b; inside = src <= high; break;
        case EMU_SHFL_XOR: src = lane ^ b; inside = src <= high; break;
    }
    if (!inside) src = lane;
    if (!(group >> src & 1u)) return ~std::uint64_t(0);
    return w.value[src];
}

// Completes the group of lanes waiting with `mask` in warp `wi` if every lane the mask names
// is there (same operation, same mask) or has returned; makes them runnable again.
void try_complete_warp(int wi, unsigned mask) {
    Launch& g = *g_launch;
    Warp& w = g.warps[wi];
    const unsigned group = mask & ~w.returned;
    if ((group & w.waiting) != group || group == 0) return;
    const int first = __builtin_ctz(group);
    const int op = w.op[first];
    unsigned votes = 0;
    for (unsigned rest = group; rest; rest &= rest - 1) {
        const int lane = __builtin_ctz(rest);
        if (w.mask[lane] != mask || w.op[lane] != op) return;
        if (w.value[lane]) votes |= 1u << lane;
    }
    for (unsigned rest = group; rest; rest &= rest - 1) {
        const int lane = __builtin_ctz(rest);
        switch (op) {
            case EMU_BALLOT: w.result[lane] = votes; break;
            case EMU_ANY: w.result[lane] = votes != 0; break;
            case EMU_ALL: w.result[lane] = votes == group; break;
            case EMU_SYNCWARP: w.result[lane] = 0; break;
            default: w.result[lane] = shuffle_result(w, group, lane); break;
        }
        g.state[wi * 32 + lane] = RUNNABLE;
    }
    w.waiting &= ~group;
}

std::string lane_list(unsigned lanes);

// A warp-wide .aligned instruction completes when all 32 lanes wait in it, at one call site:
// each lane's input is gathered into every lane's output.
void try_complete_aligned(int wi) {
    Launch& g = *g_launch;
    Warp& w = g.warps[wi];
    if (w.waiting != ~0u) return;
    for (int lane = 1; lane < 32; ++lane) {
        if (w.op[lane] != w.op[0] || w.file[lane] != w.file[0] || w.line[lane] != w.line[0]) {
            fail(format("warp %d diverged: lane 0 waits in %s, lane %d in %s: a warp-wide .aligned instruction "
                        "needs all 32 lanes at the same call", wi, waits_in(w, 0).c_str(), lane,
                        waits_in(w, lane).c_str()));
            return;
        }
    }
    const int bytes = w.bytes[0];
    for (int lane = 0; lane < 32; ++lane)
        for (int src = 0; src < 32; ++src)
            std::memcpy(static_cast<unsigned char*>(w.out[lane]) + src * bytes, w.in[src], bytes);
    for (int lane = 0; lane < 32; ++lane) g.state[wi * 32 + lane] = RUNNABLE;
    w.waiting = 0;
}

// A returned lane no longer holds anyone up: retry every group waiting in its warp; but lanes
// that wait in a warp-wide .aligned instruction now wait for ever.
void release_warp_after_return(int wi) {
    const Warp& w = g_launch->warps[wi];
    if (w.waiting && w.op[__builtin_ctz(w.waiting)] == EMU_ALIGNED) {
        const int lane = __builtin_ctz(w.waiting);
        fail(format("warp %d: lanes %s returned while lanes %s wait in %s, which all 32 lanes must execute", wi,
                    lane_list(w.returned).c_str(), lane_list(w.waiting).c_str(), waits_in(w, lane).c_str()));
        return;
    }
    unsigned untried = w.waiting;
    while (untried) {
        const unsigned mask = w.mask[__builtin_ctz(untried)];
        untried &= ~mask;  // every waiting lane's mask names the lane itself
        try_complete_warp(wi, mask);
        untried &= w.waiting;
    }
}

std::string lane_list(unsigned lanes) {
    std::string s;
    for (int lane = 0; lane < 32;) {
        if (!(lanes >> lane & 1u)) {
            ++lane;
            continue;
        }
        int end = lane;
        while (end + 1 < 32 && (lanes >> (end + 1) & 1u)) ++end;
        s += s.empty() ? "" : ",";
        s += end == lane ? format("%d", lane) : format("%d-%d", lane, end);
        lane = end + 1;
    }
    return s;
}

// ---- the scheduler -----------------------------------------------------------------------------
std::string describe_deadlock() {
    Launch& g = *g_launch;
    std::string s = format("deadlock in block (%u,%u,%u): %d of %d threads wait at __syncthreads()",
                           g.block_idx.x, g.block_idx.y, g.block_idx.z, g.at_barrier, g.live);
    for (std::size_t wi = 0; wi < g.warps.size(); ++wi) {
        const Warp& w = g.warps[wi];
        if (!w.waiting) continue;
        const int first = __builtin_ctz(w.waiting);
        s += format("; warp %zu: lanes %s wait in %s for lanes %s", wi, lane_list(w.waiting).c_str(),
                    waits_in(w, first).c_str(), lane_list(w.mask[first] & ~w.waiting & ~w.returned).c_str());
    }
    return s;
}

void release_barrier() {
    Launch& g = *g_launch;
    const int results[] = {g.barrier_sum, g.barrier_and, g.barrier_or};
    for (int i = 0; i < g.threads; ++i) {
        if (g.state[i] != AT_BARRIER) continue;
        g.state[i] = RUNNABLE;
        g.barrier_result[i] = results[g.how[i]];
    }
    g.at_barrier = 0;
    g.barrier_sum = 0;
    g.barrier_and = 1;
    g.barrier_or = 0;
}

void fill_shared_memory() {
    Launch& g = *g_launch;
    const std::size_t dyn_offset = std::size_t(g.dynamic - g.tls);
    std::memset(g.tls, 0xff, dyn_offset);
    std::memset(g.dynamic, 0xff, g.dynamic_bytes);
    std::memset(g.dynamic + g.dynamic_bytes, kSharedTail, kEmuSharedTailBytes);
    const std::size_t after = dyn_offset + kEmuDynamicSharedBytes + kEmuSharedTailBytes;
    if (after < g.tls_bytes) std::memset(g.tls + after, 0xff, g.tls_bytes - after);
}

bool dynamic_shared_tail_intact() {
    const unsigned char* tail = g_launch->dynamic + g_launch->dynamic_bytes;
    for (std::size_t i = 0; i < kEmuSharedTailBytes; ++i)
        if (tail[i] != kSharedTail) return false;
    return true;
}

void start_block(uint3 block_idx) {
    Launch& g = *g_launch;
    const dim3 b = g.block;
    g.block_idx = block_idx;
    for (int i = 0; i < g.threads; ++i) {
        emu_thread& t = g_slots.slot(i)->pub;
        t.thread_idx = uint3{unsigned(i) % b.x, unsigned(i) / b.x % b.y, unsigned(i) / (b.x * b.y)};
        t.block_idx = block_idx;
        t.block_dim = g.block;
        t.grid_dim = g.grid;
        prepare_fiber(i);
    }
    g.state.assign(g.threads, RUNNABLE);
    for (Warp& w : g.warps) w.returned = w.waiting = 0;
    const int last = g.threads - (int(g.warps.size()) - 1) * 32;
    if (last < 32) g.warps.back().returned = ~0u << last;  // lanes that do not exist
    g.live = g.threads;
    g.at_barrier = 0;
    g.barrier_sum = 0;
    g.barrier_and = 1;
    g.barrier_or = 0;
}

bool run_block(uint3 block_idx) {
    Launch& g = *g_launch;
    fill_shared_memory();
    start_block(block_idx);
    for (;;) {
        bool ran = false;
        for (int k = 0; k < g.threads; ++k) {
            const int i = g.descending ? g.threads - 1 - k : k;
            if (g.state[i] != RUNNABLE) continue;
            g.current = i;
            switch_to_fiber(i);
            g.current = -1;
            if (g.failed) return false;
            ran = true;
        }
        if (g.live == 0) break;
        if (g.at_barrier == g.live) {
            release_barrier();
            continue;
        }
        if (!ran) {
            fail(describe_deadlock());
            return false;
        }
    }
    if (!dynamic_shared_tail_intact()) {
        fail(format("block (%u,%u,%u) wrote past the %zu bytes of dynamic shared memory the launch asked for",
                    block_idx.x, block_idx.y, block_idx.z, g.dynamic_bytes));
        return false;
    }
    return true;
}

// ---- faults --------------------------------------------------------------------------------------
// SIGSEGV & co. raised by a kernel end the launch with an error: the handler (on an alternate
// stack, as the faulting fiber's stack may be what overflowed) notes what happened and jumps
// back into emu_launch, which writes the message outside the handler.
constexpr int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct Fault {
    int signal;
    std::uintptr_t address;
    int thread;
};
sigjmp_buf g_fault_jump;
Fault g_fault;
pthread_t g_launch_thread;
struct sigaction g_previous_actions[4];

void on_fault(int sig, siginfo_t* info, void*) {
    if (!g_launch || !pthread_equal(pthread_self(), g_launch_thread)) {
        // Not ours: put back the previous handler and let the fault happen again under it.
        for (int i = 0; i < 4; ++i)
            if (kFaultSignals[i] == sig) sigaction(sig, &g_previous_actions[i], nullptr);
        return;
    }
    g_fault = Fault{sig, reinterpret_cast<std::uintptr_t>(info->si_addr), g_launch->current};
    siglongjmp(g_fault_jump, 1);
}

std::string describe_fault(const Fault& f) {
    std::string what = f.signal == SIGSEGV ? "segmentation fault"
                       : f.signal == SIGBUS ? "bus error"
                       : f.signal == SIGFPE ? "arithmetic exception (integer division by zero?)"
                                            : "illegal instruction";
    const auto address = format(" at address 0x%lx", static_cast<unsigned long>(f.address));
    if (f.thread < 0) return "emulator: " + what + address + " outside any kernel thread";
    const auto guard = reinterpret_cast<std::uintptr_t>(g_slots.guard(f.thread));
    if (f.signal == SIGSEGV && f.address >= guard && f.address < guard + kEmuPageBytes)
        what = format("stack overflow (each thread has a stack of %zu KiB)",
                      (kEmuThreadOffset - kEmuPageBytes) / 1024);
    return describe_thread(f.thread) + ": " + what + address;
}

class FaultHandlers {
  public:
    FaultHandlers() {
        stack_t alt{};
        alt.ss_sp = alt_stack_;
        alt.ss_size = sizeof alt_stack_;
        sigaltstack(&alt, &previous_stack_);
        struct sigaction action {};
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        for (int i = 0; i < 4; ++i) sigaction(kFaultSignals[i], &action, &g_previous_actions[i]);
    }
    ~FaultHandlers() {
        for (int i = 0; i < 4; ++i) sigaction(kFaultSignals[i], &g_previous_actions[i], nullptr);
        sigaltstack(&previous_stack_, nullptr);
    }

  private:
    alignas(16) static inline unsigned char alt_stack_[64 * 1024];
    stack_t previous_stack_{};
};

}  // namespace

// ---- called by kernels -------------------------------------------------------------------------
extern "C" __attribute__((visibility("hidden"))) void emu_fiber_main(std::uintptr_t index) {
    Launch& g = *g_launch;
    const int i = int(index);
    g.entry(g.args);
    if (const std::size_t n = g.async[i].pending())
        fail_in_fiber(format("returned with %zu cp.async cop%s not waited for (cp.async.wait_group)", n,
                             n == 1 ? "y" : "ies"));
    g.state[i] = RETURNED;
    --g.live;
    g.warps[i / 32].returned |= 1u << (i % 32);
    release_warp_after_return(i / 32);
    switch_to_scheduler(i);
    std::abort();  // a returned fiber is never resumed
}

extern "C" int emu_syncthreads_reduce(int predicate, int how) {
    Launch& g = *g_launch;
    const int i = g.current;
    g.state[i] = AT_BARRIER;
    g.how[i] = static_cast<unsigned char>(how);
    ++g.at_barrier;
    g.barrier_sum += predicate != 0;
    g.barrier_and &= predicate != 0;
    g.barrier_or |= predicate != 0;
    switch_to_scheduler(i);
    return g.barrier_result[i];
}

extern "C" void emu_syncthreads(void) { emu_syncthreads_reduce(1, 0); }

extern "C" std::uint64_t emu_warp(int op, unsigned mask, std::uint64_t value, int arg, int width) {
    Launch& g = *g_launch;
    const int i = g.current, lane = i % 32;
    if (!(mask >> lane & 1u))
        fail_in_fiber(format("%s with mask 0x%08x, which leaves out the calling lane %d", warp_op_name(op), mask,
                             lane));
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail_in_fiber(format("%s with width %d: it must be a power of 2 from 1 to 32", warp_op_name(op), width));
    Warp& w = g.warps[i / 32];
    g.state[i] = AT_WARP;
    w.waiting |= 1u << lane;
    w.op[lane] = op;
    w.mask[lane] = mask;
    w.value[lane] = value;
    w.arg[lane] = arg;
    w.width[lane] = width;
    try_complete_warp(i / 32, mask);
    switch_to_scheduler(i);
    return w.result[lane];
}

extern "C" void emu_warp_aligned(const char* what, const char* file, int line, const void* in, int bytes,
                                 void* out) {
    Launch& g = *g_launch;
    const int i = g.current, lane = i % 32;
    Warp& w = g.warps[i / 32];
    if (w.returned)
        fail_in_fiber(format("%s at %s:%d with lanes %s of its warp returned or not there: all 32 lanes must "
                             "execute it", what, file, line, lane_list(w.returned).c_str()));
    if (bytes < 0 || bytes > kEmuAlignedBytes) fail_in_fiber(format("%s: %d bytes a lane", what, bytes));
    for (unsigned rest = w.waiting; rest; rest &= rest - 1) {
        const int other = __builtin_ctz(rest);
        if (w.op[other] == EMU_ALIGNED && (w.file[other] != file || w.line[other] != line))
            fail_in_fiber(format("reached %s at %s:%d while lane %d waits in %s: a warp-wide .aligned "
                                 "instruction needs all 32 lanes at the same call", what, file, line, other,
                                 waits_in(w, other).c_str()));
    }
    g.state[i] = AT_WARP;
    w.waiting |= 1u << lane;
    w.op[lane] = EMU_ALIGNED;
    w.mask[lane] = ~0u;
    w.what[lane] = what;
    w.file[lane] = file;
    w.line[lane] = line;
    w.in[lane] = in;
    w.bytes[lane] = bytes;
    w.out[lane] = out;
    try_complete_aligned(i / 32);
    switch_to_scheduler(i);
}

namespace {
bool in_shared(const void* p, std::size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= g_launch->tls && c + bytes <= g_launch->tls + g_launch->tls_bytes;
}

bool in_argument(const void* p, std::size_t bytes) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    for (const auto& [start, end] : g_launch->regions)
        if (a >= start && a + bytes <= end) return true;
    return false;
}
}  // namespace

extern "C" void emu_check_shared(const void* p, std::size_t bytes, std::size_t align, const char* what,
                                 const char* file, int line) {
    if (!in_shared(p, bytes))
        fail_in_fiber(format("%s at %s:%d: %zu bytes at %p are not in the block's shared memory", what, file, line,
                             bytes, p));
    if (reinterpret_cast<std::uintptr_t>(p) % align)
        fail_in_fiber(format("%s at %s:%d: address %p is not a multiple of %zu bytes", what, file, line, p, align));
}

extern "C" void emu_cp_async(void* dst, const void* src, int bytes, int src_bytes, int cache_global,
                             const char* file, int line) {
    const char* what = cache_global ? "cp.async.cg" : "cp.async.ca";
    if (!(bytes == 4 || bytes == 8 || bytes == 16) || (cache_global && bytes != 16))
        fail_in_fiber(format("%s at %s:%d copies %d bytes: .ca takes 4, 8 or 16, .cg 16", what, file, line, bytes));
    if (src_bytes < 0 || src_bytes > bytes)
        fail_in_fiber(format("%s at %s:%d: source size %d outside 0..%d", what, file, line, src_bytes, bytes));
    emu_check_shared(dst, std::size_t(bytes), std::size_t(bytes), what, file, line);
    if (reinterpret_cast<std::uintptr_t>(src) % unsigned(bytes))
        fail_in_fiber(format("%s at %s:%d: source %p is not a multiple of %d bytes", what, file, line, src, bytes));
    if (src_bytes && !in_argument(src, std::size_t(src_bytes)))
        fail_in_fiber(format("%s at %s:%d reads %d bytes at %p, outside the kernel's argument buffers (global "
                             "memory)", what, file, line, src_bytes, src));
    AsyncCopy copy{static_cast<unsigned char*>(dst), bytes, src_bytes, {}};
    std::memcpy(copy.data, src, std::size_t(src_bytes));
    std::memset(dst, 0xff, std::size_t(bytes));  // NaN until the wait that covers it
    g_launch->async[g_launch->current].open.push_back(copy);
}

extern "C" void emu_cp_async_commit(void) {
    AsyncCopies& a = g_launch->async[g_launch->current];
    a.groups.push_back(std::move(a.open));
    a.open.clear();
}

extern "C" void emu_cp_async_wait(int pending_groups) {
    AsyncCopies& a = g_launch->async[g_launch->current];
    const std::size_t keep = std::size_t(pending_groups < 0 ? 0 : pending_groups);
    while (a.groups.size() > keep) {
        for (const AsyncCopy& c : a.groups.front()) {
            std::memcpy(c.dst, c.data, std::size_t(c.src_bytes));
            std::memset(c.dst + c.src_bytes, 0, std::size_t(c.bytes - c.src_bytes));
        }
        a.groups.erase(a.groups.begin());
    }
}

extern "C" void emu_trap(const char* what) { fail_in_fiber(what); }

extern "C" void emu_assert_fail(const char* expr, const char* file, int line, const char* function) {
    fail_in_fiber(format("%s:%d: %s: device-side assertion `%s' failed", file, line, function, expr));
}

// ---- called from Python ------------------------------------------------------------------------
namespace {
int find_tls_size(dl_phdr_info* info, std::size_t, void* data) {
    auto* want = static_cast<std::pair<std::size_t, std::size_t>*>(data);
    if (info->dlpi_tls_modid != want->first) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i)
        if (info->dlpi_phdr[i].p_type == PT_TLS) want->second = info->dlpi_phdr[i].p_memsz;
    return 1;
}

void set_error(char* err, std::size_t errlen, const std::string& message) {
    std::snprintf(err, errlen, "%s", message.c_str());
}
}  // namespace

extern "C" void* emu_module_load(const char* path, char* err, std::size_t errlen) {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        set_error(err, errlen, dlerror());
        return nullptr;
    }
    auto* m = new Module{handle, nullptr, 0};
    m->dynamic_shared = reinterpret_cast<void* (*)()>(dlsym(handle, "emu_dynamic_shared_base"));
    std::size_t modid = 0;
    if (!m->dynamic_shared || dlinfo(handle, RTLD_DI_TLS_MODID, &modid) != 0 || modid == 0) {
        set_error(err, errlen, "not an emulator module (no dynamic shared memory)");
        dlclose(handle);
        delete m;
        return nullptr;
    }
    std::pair<std::size_t, std::size_t> tls{modid, 0};
    dl_iterate_phdr(find_tls_size, &tls);
    m->tls_bytes = tls.second;
    return m;
}

extern "C" void* emu_module_symbol(Module* m, const char* name) { return dlsym(m->handle, name); }

// CuPy compiles every kernel with -ftz=true: single-precision subnormal inputs and results are
// flushed to zero. While a grid runs, the CPU does the same (MXCSR's FTZ and DAZ bits on x86-64,
// FPCR.FZ on AArch64), which there also flushes double precision; the caller's mode comes back after.
class FlushSubnormals {
#if defined(__x86_64__)
    unsigned saved_ = __builtin_ia32_stmxcsr();
  public:
    FlushSubnormals() { __builtin_ia32_ldmxcsr(saved_ | 0x8040u); }
    ~FlushSubnormals() { __builtin_ia32_ldmxcsr(saved_); }
#elif defined(__aarch64__)
    std::uint64_t saved_ = __builtin_aarch64_get_fpcr64();
  public:
    FlushSubnormals() { __builtin_aarch64_set_fpcr64(saved_ | (std::uint64_t(1) << 24)); }
    ~FlushSubnormals() { __builtin_aarch64_set_fpcr64(saved_); }
#else
#error "the emulator flushes subnormals on x86-64 and AArch64 only"
#endif
};

// Runs a grid. Returns 0, or 1 with a message in err (and, after a fault, its address).
// `regions`: [start, end) of each argument buffer, `nregions` pairs.
extern "C" int emu_launch(Module* m, void (*entry)(void**), void** args, const unsigned* grid,
                          const unsigned* block, std::size_t dynamic_bytes, int descending,
                          const std::uint64_t* regions, int nregions,
                          std::uint64_t* fault_address, char* err, std::size_t errlen) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    Launch g{};
    g.entry = entry;
    g.args = args;
    for (int r = 0; r < nregions; ++r) g.regions.emplace_back(regions[2 * r], regions[2 * r + 1]);
    g.grid = dim3(grid[0], grid[1], grid[2]);
    g.block = dim3(block[0], block[1], block[2]);
    g.threads = int(block[0] * block[1] * block[2]);
    if (g.threads < 1 || g.threads > 1024) {
        set_error(err, errlen, format("emulator: %d threads per block", g.threads));
        return 1;
    }
    g.current = -1;
    g.how.assign(g.threads, 0);
    g.barrier_result.assign(g.threads, 0);
    g.warps.resize((g.threads + 31) / 32);
    g.async.assign(std::size_t(g.threads), AsyncCopies{});
    g.descending = descending != 0;
    g.dynamic_bytes = dynamic_bytes;
    g.dynamic = static_cast<unsigned char*>(m->dynamic_shared());  // allocates this thread's copy
    void* tls = nullptr;
    dlinfo(m->handle, RTLD_DI_TLS_DATA, &tls);
    g.tls = static_cast<unsigned char*>(tls);
    g.tls_bytes = m->tls_bytes;
    const bool dynamic_inside = g.tls && g.dynamic >= g.tls &&
                                g.dynamic + kEmuDynamicSharedBytes + kEmuSharedTailBytes <= g.tls + g.tls_bytes;
    if (!dynamic_inside || dynamic_bytes > kEmuDynamicSharedBytes) {
        set_error(err, errlen, "emulator: shared memory layout not as expected");
        return 1;
    }
    if (!g_slots.reserve(g.threads)) {
        set_error(err, errlen, "emulator: cannot reserve the threads' stacks");
        return 1;
    }
    g_launch = &g;
    g_launch_thread = pthread_self();
    g_fault = Fault{0, 0, -1};
    {
        FaultHandlers handlers;
        FlushSubnormals flush;  // outside sigsetjmp's branch: restored after a fault too
        if (sigsetjmp(g_fault_jump, 1) == 0) {
            const long long blocks = (long long)grid[0] * grid[1] * grid[2];
            for (long long k = 0; k < blocks && !g.failed; ++k) {
                const long long b = g.descending ? blocks - 1 - k : k;
                const uint3 idx{unsigned(b % grid[0]), unsigned(b / grid[0] % grid[1]),
                                unsigned(b / ((long long)grid[0] * grid[1]))};
                run_block(idx);
            }
        } else {
            fail(describe_fault(g_fault));
        }
    }
    g_launch = nullptr;
    *fault_address = g_fault.address;
    std::fflush(stdout);
    if (g.failed) set_error(err, errlen, g.error);
    return g.failed ? 1 : 0;
}

// Memory for a launch's copy of an array argument: `bytes` (rounded up to pages) between
// fences of inaccessible pages, so that a stray access beyond the canary zones faults.
constexpr std::size_t kFenceBytes = std::size_t(1) << 20;

extern "C" void* emu_fenced_alloc(std::size_t bytes) {
    const std::size_t rounded = (bytes + kEmuPageBytes - 1) / kEmuPageBytes * kEmuPageBytes;
    void* p = mmap(nullptr, rounded + 2 * kFenceBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return nullptr;
    unsigned char* usable = static_cast<unsigned char*>(p) + kFenceBytes;
    if (mprotect(usable, rounded, PROT_READ | PROT_WRITE) != 0) {
        munmap(p, rounded + 2 * kFenceBytes);
        return nullptr;
    }
    return usable;
}

extern "C" void emu_fenced_free(void* usable, std::size_t bytes) {
    const std::size_t rounded = (bytes + kEmuPageBytes - 1) / kEmuPageBytes * kEmuPageBytes;
    munmap(static_cast<unsigned char*>(usable) - kFenceBytes, rounded + 2 * kFenceBytes);
}
