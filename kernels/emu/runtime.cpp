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
//
// The sanitizer (a launch with `sanitize`, of a module compiled with -fsanitize=thread so that
// every load and store of the kernel calls __tsan_{read,write}N, see build.py) checks
// each access where it happens, as compute-sanitizer's tools do on a GPU: memcheck (global
// accesses inside an argument's bytes or the module's own variables, shared ones inside the
// kernel's __shared__ variables and the dynamic size the launch asked for, natural alignment),
// racecheck (a shared byte written by one thread and read or written by another with no barrier
// between, lanes of a warp needing a __syncwarp; a global byte written by two threads of the
// launch with plain stores), initcheck (a shared byte read before any thread of the block wrote
// it, or while a cp.async to it is in flight; and the value a shuffle gives a lane that reads outside its
// mask, where it is used: see poison) and synccheck (the threads a barrier releases, and the lanes of a
// warp-wide .aligned instruction, at one call instance: the same chain of return addresses, which is why
// modules are compiled with frame pointers).
//
// Hopper's mbarriers, TMA loads and warpgroup instructions (kernels/cuda/sm90.cuh's wrappers) have a section of
// their own below ("Hopper"): barriers that threads wait at until a phase completes, loads that land when issued,
// rendezvous of a warpgroup's 128 threads, and the vector clocks through which racecheck follows mbarrier hand-offs.
//
// The traffic counter (a launch with `traffic`, emu.traffic() in Python) rides on the same hooks: it
// groups the global loads of a warp into the requests a GPU's memory system sees and counts the 32-byte
// sectors they touch (LoadTraffic). Off, it costs a test on the path of global accesses only.
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

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

// AT_MBARRIER: in an mbarrier_wait for a phase to complete; AT_WARPGROUP: in a warpgroup-wide .aligned
// instruction (wgmma, setmaxnreg) for the other threads of its warpgroup (see Hopper).
// AT_NAMED: at a named barrier (sm90.cuh's named_barrier_sync: bar.sync with an id and a thread count) until
// its count of threads arrived.
enum FiberState : unsigned char { RUNNABLE, AT_BARRIER, AT_WARP, RETURNED, AT_MBARRIER, AT_WARPGROUP, AT_NAMED };

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
    bool rows[32];                 // an .aligned load of rows (ldmatrix): `in` is the row's address
    std::uint64_t path[32];        // the call instance of each lane's .aligned instruction
    const void* pc[32];            // where each lane's operation (.aligned or a shuffle) is, for messages
    // the __syncwarp()s completed since the block's last barrier: (generation, lanes); memory
    // accesses of two lanes are ordered by one that both took part in after the first access
    std::vector<std::pair<std::uint32_t, unsigned>> syncs;
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
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> segments;  // its loaded segments: __device__ variables
};

// A __shared__ variable a launch's kernel may access: [begin, end) in this OS thread's copy.
struct SharedVariable {
    std::uintptr_t begin, end;
    std::string name;
};

// What the sanitizer knows of one 4-byte word of shared memory: its last write, the reads since
// (two distinct readers are enough: any writer differs from one of them), and a cp.async in flight
// to it. Phases number the stretches between a block's barriers, over all blocks ever run, so that
// nothing is cleared between blocks: a record of an earlier block is older than the block's start.
struct ShadowWord {
    std::uint32_t w_phase, w_gen;      // the last write: its phase, and the warp's __syncwarp count then
    std::uint32_t r_phase, r_gen[2];   // the reads of the word in phase r_phase
    std::uint32_t pending;             // the phase in which a cp.async to it was issued, 0 once it landed; and
                                       // kHopperMarked where `hopper` holds marks (one test finds both)
    std::uint16_t writer, reader[2];   // threads, or the clock slot of an mbarrier's TMA loads (Hopper)
    std::uint8_t readers;
    std::uint8_t hopper;               // Hopper's marks (kMbarrierWord, kTmaWord, kWgmmaWord): see HopperWord
};

// The bit of ShadowWord::pending that says the word has Hopper's marks: one test on the path of every shared
// access finds a word that needs a closer look (a cp.async in flight, or Hopper's marks).
constexpr std::uint32_t kHopperMarked = 0x80000000u;

// The canary after the dynamic shared memory a launch asked for.
constexpr unsigned char kSharedTail = 0xa5;

// The traffic counter's view of a launch's global loads. The lanes of one warp that execute one load
// instruction (its code address) for their n-th time make one request, as a warp's load is one request
// on a GPU; a request reads each distinct 32-byte sector its lanes touch once and delivers the distinct
// bytes they asked for (a float that all lanes load counts 4 bytes, as a broadcast). A block's requests are
// complete when it ends (blocks run one at a time): then they are added to `totals`, {requests,
// sectors, bytes}.
class LoadTraffic {
  public:
    explicit LoadTraffic(std::uint64_t* totals) : totals_(totals) {}

    void load(int thread, std::uintptr_t a, std::size_t n, const void* pc) {
        if (n == 0) return;   // a memcpy of nothing
        const std::uint32_t nth = executions_[{thread, pc}]++;
        requests_[{thread / 32, pc, nth}].emplace_back(a, a + n);
    }

    void end_block() {
        for (auto& [key, ranges] : requests_) {
            std::sort(ranges.begin(), ranges.end());
            // by start: what an earlier range covered lies below `covered`, its sectors below `next_sector`
            std::uintptr_t covered = 0, next_sector = 0;
            for (const auto& [begin, end] : ranges) {
                totals_[2] += end > std::max(begin, covered) ? end - std::max(begin, covered) : 0;
                covered = std::max(covered, end);
                const std::uintptr_t first = std::max(begin / 32, next_sector), last = (end - 1) / 32;
                if (last >= first) totals_[1] += last - first + 1;
                next_sector = std::max(next_sector, last + 1);
            }
            totals_[0] += 1;
        }
        requests_.clear();
        executions_.clear();
    }

  private:
    std::uint64_t* totals_;
    std::map<std::pair<int, const void*>, std::uint32_t> executions_;   // (thread, pc): how often so far
    // (warp, pc, n-th execution): the [begin, end) its lanes loaded
    std::map<std::tuple<int, const void*, std::uint32_t>, std::vector<std::pair<std::uintptr_t, std::uintptr_t>>>
        requests_;
};

// The return addresses of a thread's calls that lead to a call into the runtime, innermost first.
constexpr int kChainDepth = 32;
struct CallChain {
    int n = 0;
    const void* ret[kChainDepth];
};

// A shuffle that gave a lane an undefined value in this launch (see poison): its code address, and what a
// message says of it. Its index in Launch::undefined is the tag its poison carries.
struct UndefinedShuffle {
    const void* pc;
    std::string what;
};

// The running thread's last store to memory while the launch has undefined values about, not yet checked
// for one (undefined_store): the instrumentation reports a store before it happens.
struct UncheckedStore {
    std::uintptr_t a;
    std::size_t n;
    const void* pc;
};

// A store to global bytes that another thread of the launch wrote (global_write): their values before.
struct RacingStore {
    int thread;
    std::uintptr_t a;
    std::vector<unsigned char> before;
    std::uint32_t other;   // the other writer (global thread + 1)
    const void* pc;
};

struct Hopper;   // the state of sm90.cuh's instructions in a launch that uses them

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
    // the named barriers 1..15 (0 is __syncthreads()'s): the threads one awaits (0: none waiting), those arrived,
    // the OR of their predicates, where the first waits; and each AT_NAMED thread's barrier
    struct Named {
        int expected, arrived, any;
        const char* file;
        int line;
    } named[16];
    std::vector<unsigned char> named_id;
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
    // the sanitizer
    const Module* module;
    int sanitize;                                     // 0 off, 1 memcheck (and synccheck), 2 every check
    std::vector<SharedVariable> shared;               // the kernel's, and the dynamic shared memory asked for
    const SharedVariable* last_shared;                // the one the last shared access lay in
    std::vector<std::uint32_t*> writers;              // of each region: the writer of each byte (global thread + 1),
                                                      // then the fences counted when it wrote (global_write)
    std::vector<RacingStore> racing;                  // the running thread's stores that race with another's
    std::uint32_t fences;                             // the __threadfence()s of the launch so far
    std::uint32_t block_fence;                        // the count at this block's last one, 0 before any
    std::vector<std::uintptr_t> acquiring, acquired;  // the words this block updated atomically, before and
                                                      // after a fence of its own (write_released)
    std::unordered_map<std::uintptr_t, std::unordered_map<std::uint32_t, std::uint32_t>> released;
                                                      // of each such word: the blocks that updated it after
                                                      // a fence, and that fence's count
    std::uint32_t block_start, phase;                 // the phase this block started in; the phase now
    std::vector<std::uint64_t> barrier_path;          // the call instance of each thread at the barrier
    std::vector<CallChain> barrier_calls;             // its chain of calls
    std::vector<std::pair<const char*, int>> barrier_site;   // and its source line
    LoadTraffic* traffic;                             // the traffic counter, or null
    std::vector<UndefinedShuffle> undefined;          // the shuffles that gave undefined values, by tag
    UncheckedStore unchecked;                         // n = 0: none
    // Shared addresses (sm90.cuh's smem_address, descriptors): a pointer into the module's thread-local block less
    // `window`, and less `window_gap` too from `window_split` on: what lies after the dynamic shared memory's 227 KiB
    // (static __shared__ variables, as the linker may place them) follows the bytes the launch asked for, as on a
    // GPU every shared address is below 228 KiB (a descriptor holds 18 bits of one). Both multiples of 1024: a
    // shared address has the pointer's low 10 bits, which the swizzles read.
    std::uintptr_t window, window_split, window_gap;
    Hopper* hopper;                                   // null until the launch uses sm90.cuh's instructions
};

Launch* g_launch = nullptr;
std::mutex g_launch_mutex;
std::vector<ShadowWord> g_shadow;   // of the running module's shared memory, by word
std::uint32_t g_phase = 0;          // of every stretch between barriers, over all blocks (see ShadowWord)
std::uint32_t g_warp_gen = 0;       // of every completed __syncwarp()
std::uintptr_t g_report_address = 0;  // an address the sanitizer refused, for the message's argument
bool g_check_values = false;        // the launch is sanitized and has given undefined values (see poison)
// Hopper's vector clocks (a launch under the full sanitizer that uses mbarriers): of each thread, for each clock
// slot (a thread, or the TMA loads of an mbarrier), the time (g_warp_gen) of the latest release by that slot which
// the thread has acquired; g_clock_slots a thread. Null when the launch keeps none.
std::uint32_t* g_clocks = nullptr;
int g_clock_slots = 0;

// A pointer into shared memory as a shared address, and back (Launch::window).
inline std::uintptr_t to_window(std::uintptr_t p) {
    const Launch& g = *g_launch;
    return p - g.window - (p >= g.window_split ? g.window_gap : 0);
}
inline std::uintptr_t from_window(std::uintptr_t a) {
    const Launch& g = *g_launch;
    return a + g.window + (a >= g.window_split - g.window - g.window_gap ? g.window_gap : 0);
}

// Whether an access made by `from` (a thread or a clock slot) at time `gen` is handed on to thread `to` through
// mbarriers: `from` released after it (an arrival, a TMA load's complete_tx) in a phase that `to` acquired.
inline bool handed_on(int from, int to, std::uint32_t gen) {
    return g_clocks && g_clocks[std::size_t(to) * std::size_t(g_clock_slots) + std::size_t(from)] > gen;
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    std::string out(std::size_t(std::max(0, std::vsnprintf(nullptr, 0, fmt, ap))), '\0');
    va_end(ap);
    std::vsnprintf(out.data(), out.size() + 1, fmt, again);
    va_end(again);
    return out;
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

// ---- the sanitizer -----------------------------------------------------------------------------
enum Access { READ = 0, WRITE = 1, ATOMIC = 2 };

// A code address in a message: resolved to its .cu line by the Python side (raw.py), which reads
// the module's line table.
std::string at(const void* pc) {
    Dl_info info{};
    if (!pc || !dladdr(pc, &info) || !info.dli_fname) return "";
    // a return address: the call is the instruction before it
    return format(" {pc:%s:%lx}", info.dli_fname,
                  static_cast<unsigned long>(reinterpret_cast<std::uintptr_t>(pc) - 1 -
                                             reinterpret_cast<std::uintptr_t>(info.dli_fbase)));
}

// The call instance of the running thread's call into the runtime: a hash of the return addresses
// of its frames, from the runtime function whose frame is `frame` up to the thread's first one,
// but the `skip` innermost; and, with `chain`, those return addresses, innermost first.
std::uint64_t call_path(void* frame, const void** first, int skip = 0, const void** second = nullptr,
                        CallChain* chain = nullptr) {
    const auto lo = reinterpret_cast<std::uintptr_t>(g_slots.guard(g_launch->current));
    const auto hi = reinterpret_cast<std::uintptr_t>(g_slots.stack_top(g_launch->current));
    std::uint64_t h = 1469598103934665603ull;
    *first = nullptr;
    auto** fp = static_cast<void**>(frame);
    for (int depth = 0; depth < 64; ++depth) {
        const auto at_fp = reinterpret_cast<std::uintptr_t>(fp);
        if (at_fp < lo || at_fp + 2 * sizeof(void*) > hi) break;
        void* ret = fp[1];
        if (depth == 1 && second) *second = ret;
        if (!*first) *first = ret;
        if (depth >= skip) h = (h ^ reinterpret_cast<std::uintptr_t>(ret)) * 1099511628211ull;
        if (depth >= skip && chain && chain->n < kChainDepth) chain->ret[chain->n++] = ret;
        fp = static_cast<void**>(fp[0]);
    }
    return h;
}

// The source place of the call before a return address ("file:line", and the places of the calls it is
// inlined into), from the module's line table by addr2line; the address itself where that cannot tell.
// Only a suspected error asks, so the cost of a process a place does not matter; each place is asked once.
const std::string& source_place(const void* ret) {
    static std::unordered_map<const void*, std::string> places;
    const auto found = places.find(ret);
    if (found != places.end()) return found->second;
    std::string place = format("%p", ret);
    Dl_info info{};
    if (dladdr(ret, &info) && info.dli_fname && !std::strchr(info.dli_fname, '\'')) {
        const auto offset = reinterpret_cast<std::uintptr_t>(ret) - 1 - reinterpret_cast<std::uintptr_t>(info.dli_fbase);
        if (FILE* out = popen(format("addr2line -i -e '%s' %lx 2>/dev/null", info.dli_fname,
                                     static_cast<unsigned long>(offset)).c_str(), "r")) {
            std::string lines;
            char buffer[4096];
            while (std::fgets(buffer, sizeof buffer, out)) {
                std::string line(buffer);
                line = line.substr(0, line.find_first_of(" \n"));   // without " (discriminator n)"
                lines += line + ";";
            }
            if (pclose(out) == 0 && !lines.empty() && lines.find("??") == std::string::npos) place = lines;
        }
    }
    return places.emplace(ret, place).first->second;
}

// Whether two chains of calls are the same calls in the source: the same return addresses, or, where
// the compiler copied a call (into the two sides of a branch, say), return addresses of the same places.
bool same_source_calls(const CallChain& a, const CallChain& b) {
    if (a.n != b.n) return false;
    for (int k = 0; k < a.n; ++k)
        if (a.ret[k] != b.ret[k] && source_place(a.ret[k]) != source_place(b.ret[k])) return false;
    return true;
}

const char* verb(int how, bool past = false) {
    if (how == WRITE) return past ? "wrote" : "writes";
    if (how == READ) return past ? "read" : "reads";
    return "atomically updates";
}

std::string thread_name(int i) {
    const emu_thread& t = g_slots.slot(i)->pub;
    return format("thread (%u,%u,%u)", t.thread_idx.x, t.thread_idx.y, t.thread_idx.z);
}

const SharedVariable* shared_variable(std::uintptr_t a, std::size_t n) {
    Launch& g = *g_launch;
    if (g.last_shared && a >= g.last_shared->begin && a + n <= g.last_shared->end) return g.last_shared;
    for (const SharedVariable& v : g.shared)
        if (a >= v.begin && a + n <= v.end) return g.last_shared = &v;
    return nullptr;
}

// memcheck of shared memory: the variable [a, a + n) lies in, or an error naming the nearest one.
const SharedVariable& shared_or_fail(std::uintptr_t a, std::size_t n, int how, const void* pc) {
    if (const SharedVariable* v = shared_variable(a, n)) return *v;
    const SharedVariable* near = nullptr;
    long distance = 0;
    for (const SharedVariable& v : g_launch->shared) {
        const long d = a < v.begin ? long(v.begin - a) : a >= v.end ? long(a - v.end + 1) : 0;
        if (!near || d < distance) near = &v, distance = d;
    }
    std::string where = near ? format("offset %ld of `%s` (%zu bytes)", long(a - near->begin), near->name.c_str(),
                                      std::size_t(near->end - near->begin))
                             : std::string("no __shared__ variable of the kernel");
    fail_in_fiber(format("memcheck: out-of-bounds shared %s of %zu bytes at %s%s",
                         how == WRITE ? "write" : how == READ ? "read" : "atomic", n, where.c_str(), at(pc).c_str()));
}

// Whether a __syncwarp() that lanes of threads a and b both took part in completed after generation g.
bool warp_synced(int a, int b, std::uint32_t g) {
    if (a / 32 != b / 32) return false;
    const unsigned both = (1u << (a % 32)) | (1u << (b % 32));
    for (const auto& [gen, lanes] : g_launch->warps[a / 32].syncs)
        if (gen > g && (lanes & both) == both) return true;
    return false;
}

// The failures of shared_shadow, out of its loop.
[[noreturn, gnu::cold, gnu::noinline]] void shadow_failure(int what, int t, std::uintptr_t a, int how,
                                                          const SharedVariable& v, const void* pc, int other) {
    const std::string place = format("byte %ld of `%s`", long(a - v.begin), v.name.c_str());
    const char* warp = other / 32 == t / 32 ? (g_clocks ? " (nor a __syncwarp() of both lanes, nor an mbarrier hand-off)"
                                                          : " (nor a __syncwarp() of both lanes)")
                                            : (g_clocks ? " (nor an mbarrier hand-off)" : "");
    if (what == 0)
        fail_in_fiber(format("initcheck: %s %s while a cp.async to it is in flight: read it after the "
                             "cp.async.wait_group that covers it (and a barrier, for another thread)%s",
                             verb(how), place.c_str(), at(pc).c_str()));
    if (what == 1)
        fail_in_fiber(format("initcheck: reads %s, which no thread of the block has written%s", place.c_str(),
                             at(pc).c_str()));
    fail_in_fiber(format("racecheck: %s %s, which %s %s, with no __syncthreads() between them%s%s", verb(how),
                         place.c_str(), thread_name(other).c_str(), what == 2 ? "wrote" : "read", warp,
                         at(pc).c_str()));
}

// Hopper's checks of a plain access to a word that sm90.cuh's instructions marked (see HopperWord).
void hopper_access(int t, ShadowWord* s, std::uintptr_t a, int how, const SharedVariable& v, const void* pc);

// An access to a word whose `pending` says more is to be checked: a cp.async in flight, Hopper's marks.
[[gnu::noinline]] void marked_access(int t, ShadowWord* s, std::uintptr_t a, int how, const SharedVariable& v,
                                     const void* pc) {
    const std::uint32_t copy = s->pending & ~kHopperMarked;
    if (copy >= g_launch->block_start && copy) shadow_failure(0, t, a, how, v, pc, t);
    if (s->pending & kHopperMarked) hopper_access(t, s, a, how, v, pc);
}

// racecheck and initcheck of thread t's access to shared [a, a + n) of variable v, word by word: an
// access of part of a word (a char, a short) is checked for initialisation, not for races (two
// threads may write two bytes of one word). `record`: false for a read done by a warp-wide
// instruction (ldmatrix), complete before any lane goes on: it is checked against earlier writes,
// but no later write can race with it.
void shared_shadow(int t, std::uintptr_t a, std::size_t n, int how, const SharedVariable& v, const void* pc,
                   bool record = true) {
    Launch& g = *g_launch;
    const std::uint32_t start = g.block_start, phase = g.phase, gen = g_warp_gen;
    const std::uintptr_t tls = reinterpret_cast<std::uintptr_t>(g.tls);
    const bool whole = (a | n) % 4 == 0;
    ShadowWord* s = &g_shadow[(a - tls) / 4];
    for (std::uintptr_t word = (a - tls) / 4 * 4 + tls; word < a + n; word += 4, ++s) {
        const std::uintptr_t at_ = word < a ? a : word;   // the access's first byte in this word
        if (__builtin_expect(s->pending >= start && s->pending, 0)) marked_access(t, s, at_, how, v, pc);
        const bool written = s->w_phase >= start && s->w_phase;
        if (__builtin_expect(how == READ && !written, 0)) shadow_failure(1, t, at_, how, v, pc, t);
        if (whole && s->w_phase == phase && s->writer != t && !warp_synced(s->writer, t, s->w_gen) &&
            !handed_on(s->writer, t, s->w_gen))
            shadow_failure(2, t, at_, how, v, pc, s->writer);
        const bool reads_now = s->r_phase == phase;
        if (how == WRITE) {
            for (int r = 0; whole && reads_now && r < s->readers; ++r)
                if (s->reader[r] != t && !warp_synced(s->reader[r], t, s->r_gen[r]) &&
                    !handed_on(s->reader[r], t, s->r_gen[r]))
                    shadow_failure(3, t, at_, how, v, pc, s->reader[r]);
            s->w_phase = phase, s->w_gen = gen, s->writer = std::uint16_t(t);
            s->r_phase = 0;
        } else if (record) {
            if (!reads_now) {
                s->r_phase = phase, s->readers = 1;
                s->reader[0] = std::uint16_t(t), s->r_gen[0] = gen;
            } else if (s->reader[0] == t) {
                s->r_gen[0] = gen;
            } else if (s->readers == 1) {
                s->reader[1] = std::uint16_t(t), s->r_gen[1] = gen, s->readers = 2;
            } else if (s->reader[1] == t) {
                s->r_gen[1] = gen;
            }
        }
    }
}

// Whether the write of global byte `a` by `writer` (global thread + 1), made when the launch had counted
// `epoch` fences, is ordered before the running thread: a block releases its writes with a
// __threadfence() and then an atomic on a word (last_block's counter), and a block that updates the same
// word atomically after, and then fences, acquires them. Blocks run one at a time here, so a release seen
// is always earlier. The model is a block's, not a thread's: the barriers around last_block's fences and
// its atomic order the block's threads.
bool write_released(std::uint32_t writer, std::uint32_t epoch) {
    const Launch& g = *g_launch;
    const std::uint32_t block = (writer - 1) / std::uint32_t(g.threads);
    for (const std::uintptr_t word : g.acquired) {
        const auto releases = g.released.find(word);
        if (releases == g.released.end()) continue;
        const auto release = releases->second.find(block);
        if (release != releases->second.end() && epoch < release->second) return true;
    }
    return false;
}

std::string thread_of(std::uint32_t writer) {
    const Launch& g = *g_launch;
    const std::uint32_t other = writer - 1, threads = std::uint32_t(g.threads);
    const std::uint32_t b = other / threads, o = other % threads;
    const dim3 bd = g.block;
    return format("thread (%u,%u,%u) of block (%u,%u,%u)", o % bd.x, o / bd.x % bd.y, o / (bd.x * bd.y), b % g.grid.x,
                  b / g.grid.x % g.grid.y, b / (g.grid.x * g.grid.y));
}

// racecheck of a global write: two threads of the launch may not write one byte with plain stores unless
// the first write is handed on (write_released). The second store of such a pair is judged by its value,
// once it has happened (check_racing_stores): one that leaves the bytes as they were (many threads
// setting one flag) loses nothing; one that changes them loses the first.
void global_write(std::size_t region, std::uintptr_t a, std::size_t n, const void* pc) {
    Launch& g = *g_launch;
    const auto [start, end] = g.regions[region];
    if (!g.writers[region]) {
        const std::size_t bytes = (end - start) * sizeof(std::uint32_t);
        void* p = mmap(nullptr, 2 * bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return;   // no room to track it: unchecked rather than wrong
        g.writers[region] = static_cast<std::uint32_t*>(p);
    }
    std::uint32_t* writers = g.writers[region];
    std::uint32_t* epochs = writers + (end - start);
    const std::uint32_t me = std::uint32_t((((g.block_idx.z * g.grid.y) + g.block_idx.y) * g.grid.x + g.block_idx.x) *
                                           std::uint32_t(g.threads) + std::uint32_t(g.current) + 1);
    for (std::size_t k = 0; k < n; ++k) {
        std::uint32_t& w = writers[a + k - start];
        if (w && w != me && !write_released(w, epochs[a + k - start])) {
            const auto byte = *reinterpret_cast<const unsigned char*>(a + k);
            RacingStore* last = g.racing.empty() ? nullptr : &g.racing.back();
            if (last && last->thread == g.current && last->a + last->before.size() == a + k && last->pc == pc)
                last->before.push_back(byte);
            else
                g.racing.push_back({g.current, a + k, {byte}, w, pc});
        }
        w = me;
        epochs[a + k - start] = g.fences;
    }
}

// The second stores of racing pairs that the running thread made (global_write), now that they have
// happened: an error for the first that changed what the first store left.
bool check_racing_stores() {
    Launch& g = *g_launch;
    for (const RacingStore& r : g.racing) {
        const auto* now = reinterpret_cast<const unsigned char*>(r.a);
        for (std::size_t k = 0; k < r.before.size(); ++k) {
            if (now[k] == r.before[k]) continue;
            g_report_address = r.a + k;
            fail(describe_thread(r.thread) + ": " +
                 format("racecheck: writes global memory at 0x%lx that %s wrote in this launch: two plain stores "
                        "to one word race (one is lost: they differ); use an atomic, give each thread its own "
                        "place, or hand it on with a fence and an atomic counter (last_block)%s",
                        static_cast<unsigned long>(r.a + k), thread_of(r.other).c_str(), at(r.pc).c_str()));
            g.racing.clear();
            return false;
        }
    }
    g.racing.clear();
    return true;
}

// A __threadfence() of the running thread, and an atomic update of global `word`: the release and the
// acquire of write_released.
void on_threadfence() {
    Launch& g = *g_launch;
    g.block_fence = ++g.fences;
    g.acquired.insert(g.acquired.end(), g.acquiring.begin(), g.acquiring.end());
    g.acquiring.clear();
}

void on_global_atomic(std::uintptr_t word) {
    Launch& g = *g_launch;
    const std::uint32_t block = ((g.block_idx.z * g.grid.y) + g.block_idx.y) * g.grid.x + g.block_idx.x;
    if (g.block_fence) g.released[word][block] = g.block_fence;
    g.acquiring.push_back(word);
}

// ---- undefined shuffle values -------------------------------------------------------------------
// A lane whose shuffle reads a lane outside the mask gets an undefined value on a GPU, which is no error
// until it is used: a partial warp's reduction reads past its last lane and discards what it gets. Here it
// gets a poison that names the shuffle: 22 payload bits, kPoisonMark above the shuffle's index in the
// launch's `undefined` (its tag). As a float, the signalling NaN of that payload; as a double, the NaN with
// the same payload at the top of its mantissa (each converts to the other); as an integer, those bits. The
// CPU's float arithmetic hands a NaN operand's payload on (quietened, its sign perhaps flipped), so a float
// computed from a poison is one too; integer arithmetic does not. Under the sanitizer a poison is refused
// where it is used: written to memory (undefined_store), compared (the module's comparison hooks), an
// atomic's operand, a warp operation's mask or lane, a barrier's predicate (check_defined), or indexing an
// address (check_address_defined).
constexpr int kPoisonTagBits = 10;
constexpr std::uint64_t kPoisonMark = 0xa5a;   // 12 bits, 22 with the tag

std::uint64_t poison(std::uint64_t tag, int bytes) {
    const std::uint64_t payload = kPoisonMark << kPoisonTagBits | tag;
    return bytes == 8 ? 0x7ff0000000000000ull | payload << 29 : 0x7f800000u | payload;
}

// The tag of the poison that `bits` (a value of `bytes`) are, or -1.
int poison_tag(std::uint64_t bits, int bytes) {
    std::uint64_t payload;
    if (bytes == 4) {
        const std::uint32_t x = std::uint32_t(bits) & 0x7fbfffffu;   // without the sign and the quiet bit
        if (x >> 23 != 0xff) return -1;
        payload = x & 0x3fffff;
    } else if (bytes == 8) {
        const std::uint64_t x = bits & 0x7ff7ffffffffffffull;
        if (x >> 52 != 0x7ff || (x & ((std::uint64_t(1) << 29) - 1))) return -1;
        payload = x >> 29 & 0x3fffff;
    } else {
        return -1;   // a shuffle's value has 4 or 8 bytes
    }
    const std::uint64_t tag = payload & ((std::uint64_t(1) << kPoisonTagBits) - 1);
    return payload >> kPoisonTagBits == kPoisonMark && tag < g_launch->undefined.size() ? int(tag) : -1;
}

// An error if `bits` (a value of `bytes`) are a poison: `use` says how the running thread uses the value.
void check_defined(std::uint64_t bits, int bytes, const char* use, const void* pc) {
    const int tag = poison_tag(bits, bytes);
    if (__builtin_expect(tag >= 0, 0))
        fail_in_fiber(format("initcheck: uses an undefined value %s%s: %s", use, at(pc).c_str(),
                             g_launch->undefined[std::size_t(tag)].what.c_str()));
}

// The check of the running thread's last store (Launch::unchecked), now that it has happened: an error message
// if it wrote a poison, else "".
std::string undefined_store() {
    Launch& g = *g_launch;
    const UncheckedStore store = g.unchecked;
    g.unchecked.n = 0;
    for (std::size_t o = 0; o + 4 <= store.n; o += 4) {
        std::uint32_t four;
        std::memcpy(&four, reinterpret_cast<const void*>(store.a + o), 4);
        int tag = poison_tag(four, 4);
        if (tag < 0 && o % 8 == 0 && o + 8 <= store.n) {
            std::uint64_t eight;
            std::memcpy(&eight, reinterpret_cast<const void*>(store.a + o), 8);
            tag = poison_tag(eight, 8);
        }
        if (tag < 0) continue;
        const std::uintptr_t a = store.a + o;
        std::string place;
        if (const SharedVariable* v = shared_variable(a, 4)) {
            place = format("byte %ld of `%s`", long(a - v->begin), v->name.c_str());
        } else {
            place = format("global memory at 0x%lx", static_cast<unsigned long>(a));
            g_report_address = a;
        }
        return format("initcheck: writes an undefined value to %s%s: %s", place.c_str(), at(store.pc).c_str(),
                      g.undefined[std::size_t(tag)].what.c_str());
    }
    return "";
}

// Checks the running thread's last store, if it is not yet checked.
inline void settle_store() {
    if (__builtin_expect(g_launch->unchecked.n != 0, 0)) {
        const std::string error = undefined_store();
        if (!error.empty()) fail_in_fiber(error);
    }
}

// An error if an access to [a, a + n) outside the launch's memory is at the address of a poison used as an
// index: a place in the launch's memory (an argument, a __shared__ variable, the module's own variables, the
// thread's stack) plus the poison times an element size.
void check_address_defined(std::uintptr_t a, std::size_t n, int how, const void* pc) {
    Launch& g = *g_launch;
    const auto stack = reinterpret_cast<std::uintptr_t>(g_slots.guard(g.current));
    for (std::size_t tag = 0; tag < g.undefined.size(); ++tag)
        for (const int bytes : {4, 8})
            for (std::uintptr_t size = 1; size <= 16; size *= 2) {
                const std::uintptr_t base = a - std::uintptr_t(poison(tag, bytes)) * size;
                std::string place;
                if (const SharedVariable* v = shared_variable(base, 0)) {
                    place = format("byte %ld of `%s`", long(base - v->begin), v->name.c_str());
                } else if (base - stack < kEmuSlotBytes) {
                    place = "the thread's own stack (a local array)";
                } else {
                    for (const auto& [start, end] : g.regions)
                        if (base >= start && base <= end) {
                            place = format("0x%lx", static_cast<unsigned long>(base));
                            g_report_address = base;   // the message ends with the argument it lies in
                        }
                    for (const auto& [start, end] : g.module->segments)
                        if (base >= start && base <= end) place = "a variable of the module";
                }
                if (!place.empty())
                    fail_in_fiber(format("initcheck: uses an undefined value in the address of a %zu-byte %s%s: %s; "
                                         "the address is %zu times the value past %s", n,
                                         how == WRITE ? "write" : how == READ ? "read" : "atomic", at(pc).c_str(),
                                         g.undefined[tag].what.c_str(), std::size_t(size), place.c_str()));
            }
}

// Every check of a kernel's access to [a, a + n): `aligned`, the natural alignment of an n-byte access.
void check_access(std::uintptr_t a, std::size_t n, int how, bool aligned, const void* pc) {
    Launch& g = *g_launch;
    if (aligned && (a & (n - 1))) {   // n is a power of 2 where `aligned`
        g_report_address = a;
        fail_in_fiber(format("memcheck: misaligned %zu-byte %s at 0x%lx (a multiple of %zu is needed)%s", n,
                             how == WRITE ? "write" : how == READ ? "read" : "atomic", static_cast<unsigned long>(a), n,
                             at(pc).c_str()));
    }
    const auto tls = reinterpret_cast<std::uintptr_t>(g.tls);
    if (a + kEmuPageBytes >= tls && a < tls + g.tls_bytes + kEmuPageBytes) {   // shared memory, or just past it
        const SharedVariable* last = g.last_shared;
        const SharedVariable& v = last && a >= last->begin && a + n <= last->end ? *last : shared_or_fail(a, n, how, pc);
        if (how != ATOMIC && g.sanitize > 1) shared_shadow(g.current, a, n, how, v, pc);
        return;
    }
    for (std::size_t r = 0; r < g.regions.size(); ++r) {
        const auto [start, end] = g.regions[r];
        if (a < start || a >= end) continue;
        if (a + n > end) break;
        if (how == WRITE && g.sanitize > 1) global_write(r, a, n, pc);
        if (how == ATOMIC && g.sanitize > 1) on_global_atomic(a);
        if (how == READ && g.traffic) g.traffic->load(g.current, a, n, pc);
        return;
    }
    for (const auto& [start, end] : g.module->segments)
        if (a >= start && a + n <= end) return;   // the module's own variables (__device__, constants)
    if (g_check_values) check_address_defined(a, n, how, pc);
    g_report_address = a;
    fail_in_fiber(format("memcheck: out-of-bounds global %s of %zu bytes at 0x%lx%s",
                         how == WRITE ? "write" : how == READ ? "read" : "atomic", n, static_cast<unsigned long>(a),
                         at(pc).c_str()));
}

inline void instrumented(std::uintptr_t a, std::size_t n, int how, bool aligned, const void* pc) {
    Launch* g = g_launch;
    if (!g || !g->sanitize || g->current < 0) return;
    settle_store();
    if (a - reinterpret_cast<std::uintptr_t>(g_slots.base) < std::size_t(g_slots.count) * kEmuSlotBytes) return;
    if (__builtin_expect(g_check_values, 0) && how != READ) g->unchecked = {a, n, pc};
    // the common case: an aligned access to the shared variable of the last shared access
    const SharedVariable* last = g->last_shared;
    if (last && a >= last->begin && a + n <= last->end && !(aligned && (a & (n - 1)))) {
        if (g->sanitize > 1 && how != ATOMIC) shared_shadow(g->current, a, n, how, *last, pc);
        return;
    }
    check_access(a, n, how, aligned, pc);
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

// The lane a lane's shuffle reads under PTX's shfl.sync rules: CUDA's width w becomes the segment mask
// 32 - w, the source lane or offset is taken modulo 32, and a source outside the lane's segment is the
// lane itself.
int shuffle_source(const Warp& w, int lane) {
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
    return inside ? src : lane;
}

std::string lane_list(unsigned lanes);

// A shuffle whose mask names lanes that returned or do not exist (NVIDIA's CUDA C++ guidelines, 2.1 and
// 2.3): an error for the group, or false. (Its lanes then read lanes of the mask, which all execute it, or
// lanes outside the mask, whose values are undefined: undefined_value.)
bool shuffle_without_its_lanes(int wi, unsigned mask, unsigned group) {
    const Warp& w = g_launch->warps[wi];
    const int first = __builtin_ctz(group);
    if (!(mask & w.returned)) return false;
    fail(describe_thread(wi * 32 + first) +
         format(": %s(mask 0x%08x) names lanes %s, which have returned or are not in the block (of %d "
                "threads): a shuffle's mask may name only lanes that execute it (the values are undefined on a "
                "GPU)%s", warp_op_name(w.op[first]), mask, lane_list(mask & w.returned).c_str(), g_launch->threads,
                at(w.pc[first]).c_str()));
    return true;
}

// The poison for lane `lane` of warp `wi`, whose shuffle reads lane `src`, outside the mask: a value that is
// undefined on a GPU, an error only where it is used (see poison).
std::uint64_t undefined_value(int wi, int lane, int src) {
    Launch& g = *g_launch;
    const Warp& w = g.warps[wi];
    std::size_t tag = 0;
    while (tag < g.undefined.size() && g.undefined[tag].pc != w.pc[lane]) ++tag;
    if (tag == g.undefined.size()) {
        if (tag == std::size_t(1) << kPoisonTagBits) {
            fail(describe_thread(wi * 32 + lane) +
                 format(": %s%s reads lane %d, outside the mask: more shuffles of this launch read outside their "
                        "masks than the emulator tells apart (%zu)", warp_op_name(w.op[lane]), at(w.pc[lane]).c_str(),
                        src, tag));
            return 0;
        }
        g_check_values = g.sanitize != 0;
        g.undefined.push_back({w.pc[lane], format("what %s%s gives a lane that reads one outside the mask (the first: "
                                                  "lane %d of %s, which read lane %d, not in mask 0x%08x)",
                                                  warp_op_name(w.op[lane]), at(w.pc[lane]).c_str(), lane,
                                                  describe_thread(wi * 32 + lane).c_str(), src, w.mask[lane])});
    }
    return poison(tag, w.bytes[lane]);
}

void join_warp_clocks(int wi, unsigned lanes);   // (Hopper) a __syncwarp() orders what its lanes acquired

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
    if (op <= EMU_SHFL_XOR && shuffle_without_its_lanes(wi, mask, group)) return;
    for (unsigned rest = group; rest; rest &= rest - 1) {
        const int lane = __builtin_ctz(rest);
        switch (op) {
            case EMU_BALLOT: w.result[lane] = votes; break;
            case EMU_ANY: w.result[lane] = votes != 0; break;
            case EMU_ALL: w.result[lane] = votes == group; break;
            case EMU_SYNCWARP: w.result[lane] = 0; break;
            default: {
                const int src = shuffle_source(w, lane);
                w.result[lane] = group >> src & 1u ? w.value[src] : undefined_value(wi, lane, src);
                break;
            }
        }
        g.state[wi * 32 + lane] = RUNNABLE;
    }
    w.waiting &= ~group;
    if (op == EMU_SYNCWARP) {
        w.syncs.emplace_back(++g_warp_gen, group);
        if (g_clocks) join_warp_clocks(wi, group);
    }
}

// A warp-wide .aligned instruction completes when all 32 lanes wait in it, at one call site:
// each lane's input is gathered into every lane's output.
// Lanes that returned (or do not exist) make it an error, once every lane has either returned or
// arrived, so that the message does not depend on the order the lanes run in.
void try_complete_aligned(int wi) {
    Launch& g = *g_launch;
    Warp& w = g.warps[wi];
    if ((w.waiting | w.returned) != ~0u) return;
    if (w.returned) {
        const int lane = __builtin_ctz(w.waiting);
        fail(describe_thread(wi * 32 + lane) +
             format(": synccheck: %s at %s:%d with lanes %s of its warp returned or not there: all 32 lanes must "
                    "execute it", w.what[lane], w.file[lane], w.line[lane], lane_list(w.returned).c_str()));
        return;
    }
    for (int lane = 1; lane < 32; ++lane) {
        if (w.op[lane] != w.op[0] || w.path[lane] != w.path[0] || w.rows[lane] != w.rows[0]) {
            fail(format("synccheck: warp %d diverged: lane 0 waits in %s%s, lane %d in %s%s: a warp-wide .aligned "
                        "instruction needs all 32 lanes at the same call", wi, waits_in(w, 0).c_str(),
                        at(w.pc[0]).c_str(), lane, waits_in(w, lane).c_str(), at(w.pc[lane]).c_str()));
            return;
        }
    }
    const int bytes = w.bytes[0];
    if (w.rows[0]) {   // the rows are read now, all at once, as the instruction reads them
        const int arriving = g.current;
        unsigned char rows[32][kEmuAlignedBytes];
        for (int src = 0; src < 32; ++src) {
            const auto row = reinterpret_cast<std::uintptr_t>(w.in[src]);
            if (!row) {
                std::memset(rows[src], 0, std::size_t(bytes));
                continue;
            }
            if (g.sanitize > 1) {
                g.current = wi * 32 + src;   // the lane that gave the row reads it
                shared_shadow(g.current, row, std::size_t(bytes), READ,
                              shared_or_fail(row, std::size_t(bytes), READ, w.pc[src]), w.pc[src], false);
            }
            std::memcpy(rows[src], w.in[src], std::size_t(bytes));
        }
        g.current = arriving;
        for (int lane = 0; lane < 32; ++lane)
            for (int src = 0; src < 32; ++src)
                std::memcpy(static_cast<unsigned char*>(w.out[lane]) + src * bytes, rows[src], bytes);
    } else {
        for (int lane = 0; lane < 32; ++lane)
            for (int src = 0; src < 32; ++src)
                std::memcpy(static_cast<unsigned char*>(w.out[lane]) + src * bytes, w.in[src], bytes);
    }
    for (int lane = 0; lane < 32; ++lane) g.state[wi * 32 + lane] = RUNNABLE;
    w.waiting = 0;
}

// A returned lane no longer holds anyone up: retry every group waiting in its warp; but lanes
// that wait in a warp-wide .aligned instruction now wait for ever (try_complete_aligned says so).
void release_warp_after_return(int wi) {
    const Warp& w = g_launch->warps[wi];
    if (w.waiting && w.op[__builtin_ctz(w.waiting)] == EMU_ALIGNED) {
        try_complete_aligned(wi);
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

// ---- Hopper: mbarrier, TMA, wgmma (kernels/cuda/sm90.cuh) --------------------------------------------
// The emulation of sm90.cuh's wrappers (README.md, "Hopper"), and what the sanitizer makes of them:
//   - An mbarrier is the runtime's record (MBarrier), found by its address in shared memory: its phase, the
//     arrivals and transaction bytes pending. A thread in mbarrier_wait for a phase that has not completed yields
//     to the scheduler (AT_MBARRIER) until the arrival or TMA load that completes it; a block whose threads are
//     all blocked is a deadlock, reported with each barrier's state and who waits for it.
//   - A TMA load happens when it is issued: the box is read from the launch's copy of the tensor, written to
//     shared memory (swizzled) and its bytes completed on the barrier at once. When the bytes land on a GPU is
//     open; so under the full sanitizer a thread may read them only once it observed the completion of the
//     barrier's phase they count in.
//   - A warpgroup-wide instruction (wgmma.*, setmaxnreg) is a rendezvous of the 128 threads of a warpgroup at one
//     call instance, as an .aligned warp instruction is of the 32 lanes of a warp; the last thread to arrive
//     executes it for all. A wgmma computes at once, from shared memory as it is then; its result stays pending
//     in the runtime (the thread's accumulators hold a poison, see poison) until the wgmma_wait that retires its
//     group writes it back.
//   - Under the full sanitizer, vector clocks (g_clocks) order the threads' accesses through mbarriers: an arrival
//     releases what the thread did and acquired before it; a TMA load's complete_tx releases its bytes (through a
//     clock slot of the barrier's own, an agent); a wait that sees a phase complete acquires the releases of every
//     phase completed so far; __syncthreads() and __syncwarp() join the clocks of the threads they order. Times
//     are g_warp_gen, which every release ticks. racecheck asks them (handed_on) before it calls two accesses a
//     race, and the shadow's Hopper marks (HopperWord) say what plain accesses, TMA loads and wgmmas must respect.
constexpr int kWarpgroupThreads = 128;
constexpr int kMaxWarpgroups = 1024 / kWarpgroupThreads;
constexpr int kMaxTmaBarriers = 64;   // the mbarriers of a block that TMA loads complete on (a clock slot each)
constexpr unsigned kMaxTxCount = (1u << 20) - 1;   // PTX's bound of an mbarrier's count and tx-count

enum : std::uint8_t { kMbarrierWord = 1, kTmaWord = 2, kWgmmaWord = 4 };

// What a word's Hopper marks (ShadowWord::hopper) mean, cleared at the start of every block (g_hopper_touched):
// kMbarrierWord, it is part of an initialised mbarrier (`barrier`, index + 1), which only mbarrier_* may touch;
// kTmaWord, a TMA load (`tma`, index + 1 in Hopper::tmas) wrote it, and a thread may read or overwrite it once it
// observed the phase that load completed on; kWgmmaWord, the wgmmas of warpgroups read it (`wgmma`: of each
// warpgroup, its last such wgmma by serial), and a write must wait until they are retired and that is handed on.
struct HopperWord {
    std::uint32_t tma, barrier;
    std::uint32_t wgmma[kMaxWarpgroups];
};
std::vector<HopperWord> g_hopper_words;        // beside g_shadow, word by word
std::vector<std::uint32_t> g_hopper_touched;   // the words marked since the block started

struct MBarrier {
    std::uintptr_t address = 0;
    unsigned count = 0, pending = 0;   // arrivals a phase awaits, and those still pending in this one
    long long tx = 0;                  // transaction bytes pending (negative: completed before they were expected)
    std::uint32_t phase = 0;           // the phases completed
    int init_thread = -1;
    std::uint32_t init_time = 0, init_block_phase = 0;
    const char* init_file = nullptr;
    int init_line = 0;
    int agent = -1;                    // the clock slot of the TMA loads that complete on it
    std::vector<std::uint32_t> pending_clock, released;   // the releases of this phase; of those completed
    std::vector<int> waiters;
};

struct TmaLoad {
    const char* file;
    int line, barrier, issuer;
    std::uint32_t phase, time;   // the barrier's phase its bytes count in; when it wrote them
};

// A thread's accumulator array of wgmmas (its `d`), from its first wgmma on.
struct Accumulator {
    float* d;
    int n;                  // the wgmma's N: d holds N / 2 floats
    bool pending;           // a wgmma writes it: `values` is its result, d holds `poison`
    std::uint32_t group;    // the group of its last wgmma, 0 while that is not committed
    std::uint32_t poison;
    std::uint32_t retired;  // when the wgmma_wait that retired it ran (not pending): `values` is what it wrote
    const char* file;       // its last wgmma
    int line;
    float values[64];
};

struct HopperThread {
    std::vector<Accumulator> acc;
    std::uint32_t wgmma_fence = 0, last_wait = 0, proxy_fence = 0;   // when it last ran each
    int wait_barrier = -1;   // AT_MBARRIER: the barrier (index), the parity and the call
    unsigned wait_parity = 0;
    const char* wait_file = nullptr;
    int wait_line = 0;
};

enum WarpgroupOp : int { WG_FENCE, WG_COMMIT, WG_WAIT, WG_MMA, WG_SETMAXNREG };

// A thread's part in a warpgroup-wide instruction: its call instance and operands.
struct WarpgroupCall {
    int op;
    const char* file;
    int line;
    std::uint64_t path;
    CallChain chain;
    float* d;
    int n, accumulate, arg;
    std::uint64_t a, b;
    bool tf32;   // WG_MMA: wgmma_tf32 (m64nNk8, TF32 operands), else wgmma_bf16 (m64nNk16)
};

struct WgmmaOp {
    std::uint32_t group, retired;   // its group (0: not committed yet); when a wait retired it (0: not yet)
    const char* file;
    int line;
};

struct Warpgroup {
    int arrived = 0, first = -1;   // the threads waiting in an instruction, and one of them
    WarpgroupCall call[kWarpgroupThreads];
    std::vector<WgmmaOp> ops;      // its wgmmas in this block, by serial - 1
    std::uint32_t groups = 0;      // the groups committed
};

struct Hopper {
    int threads = 0, slots = 0, first_agent = 0, agents = 0;
    bool clocks = false;                     // the full sanitizer: vector clocks and the shadow's marks
    std::vector<std::uint32_t> acquired;     // g_clocks
    std::vector<MBarrier> barriers;
    std::unordered_map<std::uintptr_t, int> barrier_at;
    std::vector<TmaLoad> tmas;
    std::vector<HopperThread> thread;
    std::vector<Warpgroup> warpgroups;
    std::map<std::pair<std::string, int>, std::size_t> poison_tags;   // of each wgmma call site, in the launch
    std::vector<unsigned char> box;          // a TMA load's box
    std::vector<double> a, b;                // a wgmma's operands
};

inline std::uint32_t tick() { return ++g_warp_gen; }

std::uint32_t* clock_of(int thread) { return g_clocks + std::size_t(thread) * std::size_t(g_clock_slots); }

void join_clock(std::uint32_t* into, const std::uint32_t* from) {
    for (int k = 0; k < g_clock_slots; ++k) into[k] = std::max(into[k], from[k]);
}

void clear_hopper_words() {
    for (const std::uint32_t w : g_hopper_touched) {
        g_shadow[w].hopper = 0;
        g_shadow[w].pending &= ~kHopperMarked;
        g_hopper_words[w] = HopperWord{};
    }
    g_hopper_touched.clear();
}

void reset_hopper_block(Hopper& h) {
    h.agents = 0;
    h.barriers.clear();
    h.barrier_at.clear();
    h.tmas.clear();
    for (HopperThread& t : h.thread) t = HopperThread{};
    for (Warpgroup& w : h.warpgroups) {
        w.arrived = 0;
        w.first = -1;
        w.ops.clear();
        w.groups = 0;
    }
    std::fill(h.acquired.begin(), h.acquired.end(), 0u);
    clear_hopper_words();
}

// The launch's Hopper state, made at its first use of sm90.cuh's instructions.
Hopper& hopper() {
    Launch& g = *g_launch;
    if (!g.hopper) {
        auto* h = new Hopper;
        h->threads = g.threads;
        h->first_agent = (g.threads + 31) / 32 * 32;
        h->slots = h->first_agent + kMaxTmaBarriers;
        h->clocks = g.sanitize > 1;
        h->thread.resize(std::size_t(g.threads));
        h->warpgroups.resize(std::size_t((g.threads + kWarpgroupThreads - 1) / kWarpgroupThreads));
        if (h->clocks) {
            h->acquired.assign(std::size_t(g.threads) * std::size_t(h->slots), 0u);
            g_clocks = h->acquired.data();
            g_clock_slots = h->slots;
            if (g_hopper_words.size() < g_shadow.size()) g_hopper_words.resize(g_shadow.size());
        }
        g.hopper = h;
    }
    return *g.hopper;
}

// __syncthreads() (every thread) and __syncwarp() (its lanes) order what they join: each releases what it did
// before (its own slot, now: a wgmma its warpgroup's wait retired before the barrier is then ordered before what
// the others do after it), and each gets what all released and acquired.
void join_block_clocks() {
    Launch& g = *g_launch;
    const std::uint32_t now = tick();
    std::vector<std::uint32_t> all(std::size_t(g_clock_slots), 0u);
    for (int t = 0; t < g.threads; ++t) {
        if (g.state[t] == AT_BARRIER) clock_of(t)[t] = now;
        join_clock(all.data(), clock_of(t));
    }
    for (int t = 0; t < g.threads; ++t) std::copy(all.begin(), all.end(), clock_of(t));
}

// Some threads ordered among themselves (a __syncwarp()'s lanes, a named barrier's threads): each releases what it
// did before, and gets what all released and acquired.
void join_thread_clocks(const std::vector<int>& threads) {
    const std::uint32_t now = tick();
    std::vector<std::uint32_t> all(std::size_t(g_clock_slots), 0u);
    for (const int t : threads) {
        clock_of(t)[t] = now;
        join_clock(all.data(), clock_of(t));
    }
    for (const int t : threads) std::copy(all.begin(), all.end(), clock_of(t));
}

void join_warp_clocks(int wi, unsigned lanes) {
    std::vector<int> threads;
    for (unsigned rest = lanes; rest; rest &= rest - 1) threads.push_back(wi * 32 + __builtin_ctz(rest));
    join_thread_clocks(threads);
}

// ---- messages
std::string shared_place(std::uintptr_t a) {
    if (const SharedVariable* v = shared_variable(a, 1))
        return format("byte %ld of `%s`", long(a - v->begin), v->name.c_str());
    return format("shared address 0x%lx", static_cast<unsigned long>(to_window(a)));
}

std::string barrier_name(const MBarrier& b) { return "the mbarrier at " + shared_place(b.address); }

std::string barrier_state(const MBarrier& b) {
    return format("phase %u: %u of %u arrivals and %lld transaction bytes pending", b.phase, b.pending, b.count, b.tx);
}

// Threads by their linear index in the block ("threads 128-255").
std::string thread_list(const std::vector<int>& threads) {
    std::vector<int> sorted(threads);
    std::sort(sorted.begin(), sorted.end());
    std::string s;
    for (std::size_t k = 0; k < sorted.size();) {
        std::size_t end = k;
        while (end + 1 < sorted.size() && sorted[end + 1] == sorted[end] + 1) ++end;
        s += s.empty() ? "" : ",";
        s += end == k ? format("%d", sorted[k]) : format("%d-%d", sorted[k], sorted[end]);
        k = end + 1;
    }
    return (sorted.size() == 1 ? "thread " : "threads ") + s;
}

std::string warpgroup_name(int wg) {
    return format("warpgroup %d (threads %d-%d)", wg, wg * kWarpgroupThreads, wg * kWarpgroupThreads + kWarpgroupThreads - 1);
}

// An error of thread `thread`, found by the running thread (which ends its turn).
[[noreturn]] void fail_for(int thread, const std::string& message) {
    fail(describe_thread(thread) + ": " + message);
    switch_to_scheduler(g_launch->current);
    std::abort();
}

// The __shared__ variable (or dynamic shared memory) that holds [a, a + n) for `what` at file:line, or a memcheck
// error naming the nearest one.
const SharedVariable& shared_operand(std::uintptr_t a, std::size_t n, const std::string& what, const char* file,
                                     int line) {
    if (const SharedVariable* v = shared_variable(a, n)) return *v;
    const SharedVariable* inside = shared_variable(a, 1);
    const std::string where = inside ? format("byte %ld of `%s` (%zu bytes)", long(a - inside->begin),
                                              inside->name.c_str(), std::size_t(inside->end - inside->begin))
                                     : format("%p", reinterpret_cast<const void*>(a));
    fail_in_fiber(format("memcheck: %s at %s:%d: %zu bytes at %s %s", what.c_str(), file, line, n, where.c_str(),
                         inside ? "run past its end" : "are not in a __shared__ variable of the kernel nor in the "
                                                       "dynamic shared memory the launch asked for"));
}

// ---- mbarriers
int find_barrier(void* bar, const char* what, const char* file, int line, bool init) {
    Hopper& h = hopper();
    const auto a = reinterpret_cast<std::uintptr_t>(bar);
    const auto found = h.barrier_at.find(a);
    if (found != h.barrier_at.end()) return found->second;
    shared_operand(a, 8, format("%s of an mbarrier", what), file, line);
    if (a % 8)
        fail_in_fiber(format("memcheck: %s at %s:%d: the mbarrier at %s is not 8-byte aligned", what, file, line,
                             shared_place(a).c_str()));
    if (!init)
        fail_in_fiber(format("synccheck: %s at %s:%d uses the mbarrier at %s, which no mbarrier_init initialised", what,
                             file, line, shared_place(a).c_str()));
    h.barrier_at.emplace(a, int(h.barriers.size()));
    h.barriers.emplace_back();
    h.barriers.back().address = a;
    return int(h.barriers.size()) - 1;
}

// A thread other than the one that initialised a barrier may use it once the init is ordered before: a
// __syncthreads() since (after fence_barrier_init()), or an mbarrier hand-off.
void check_init_visible(const MBarrier& b, const char* what, const char* file, int line) {
    const Launch& g = *g_launch;
    const int t = g.current;
    if (t == b.init_thread || g.phase != b.init_block_phase || handed_on(b.init_thread, t, b.init_time)) return;
    fail_in_fiber(format("synccheck: %s at %s:%d uses %s, which %s initialised at %s:%d with no __syncthreads() "
                         "since: initialise the barriers, fence_barrier_init(), then __syncthreads() before any other "
                         "thread uses them", what, file, line, barrier_name(b).c_str(), thread_name(b.init_thread).c_str(),
                         b.init_file, b.init_line));
}

// Completes the barrier's phase if nothing is pending, and wakes the threads that waited for it.
void complete_phase(MBarrier& b) {
    if (b.pending != 0 || b.tx != 0) return;
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    ++b.phase;
    b.pending = b.count;
    if (h.clocks) {
        join_clock(b.released.data(), b.pending_clock.data());
        std::fill(b.pending_clock.begin(), b.pending_clock.end(), 0u);
    }
    std::vector<int> still;
    for (const int w : b.waiters) {
        HopperThread& t = h.thread[std::size_t(w)];
        if ((b.phase & 1) == t.wait_parity) {
            still.push_back(w);
            continue;
        }
        if (h.clocks) join_clock(clock_of(w), b.released.data());
        t.wait_barrier = -1;
        g.state[std::size_t(w)] = RUNNABLE;
    }
    b.waiters.swap(still);
}

void check_tx_range(const MBarrier& b, const char* what, const char* file, int line) {
    if (b.tx > kMaxTxCount || b.tx < -static_cast<long long>(kMaxTxCount))
        fail_in_fiber(format("synccheck: %s at %s:%d leaves %s with a transaction count of %lld bytes, outside PTX's "
                             "+-(2^20-1)", what, file, line, barrier_name(b).c_str(), b.tx));
}

// ---- the shadow's Hopper marks
void mark_word(std::size_t idx, std::uint8_t mark) {
    ShadowWord& s = g_shadow[idx];
    if (!s.hopper) g_hopper_touched.push_back(std::uint32_t(idx));
    s.hopper |= mark;
    s.pending |= kHopperMarked;
}

void unmark_word(ShadowWord& s, std::uint8_t mark) {
    s.hopper &= std::uint8_t(~mark);
    if (!s.hopper) s.pending &= ~kHopperMarked;
}

std::size_t word_index(std::uintptr_t a) { return (a - reinterpret_cast<std::uintptr_t>(g_launch->tls)) / 4; }

// What writes a word, for a message: the TMA load at file:line, or (no file) a plain store at pc.
std::string writer_name(const char* file, int line, const void* pc) {
    return file ? format("the TMA load at %s:%d", file, line) : format("a plain store%s", at(pc).c_str());
}

// A write by thread `writer` (its plain store at pc, or the TMA load at file:line it issued) to the word at a that
// wgmmas read (kWgmmaWord): each must be retired, and its retirement handed on to the writer (a thread of its
// warpgroup arriving on an mbarrier after its wgmma_wait, the writer waiting for that phase), else the write races
// with it. `verified`: of each warpgroup, the serial of a wgmma already found ordered before this writer, or 0.
void check_wgmma_readers(int writer, std::uintptr_t a, const char* file, int line, const void* pc,
                         std::uint32_t* verified) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    const std::size_t idx = word_index(a);
    HopperWord& hw = g_hopper_words[idx];
    for (int wg = 0; wg < kMaxWarpgroups; ++wg) {
        const std::uint32_t serial = hw.wgmma[wg];
        if (!serial || (verified && verified[wg] == serial)) continue;
        const WgmmaOp& op = h.warpgroups[std::size_t(wg)].ops[serial - 1];
        if (!op.retired)
            fail_in_fiber(format("racecheck: %s writes %s while the wgmma at %s:%d of %s reads it: that wgmma is not "
                                 "retired yet (a stage released before the wgmma_wait that retires the wgmmas reading "
                                 "it)", writer_name(file, line, pc).c_str(), shared_place(a).c_str(), op.file, op.line,
                                 warpgroup_name(wg).c_str()));
        bool ordered = writer / kWarpgroupThreads == wg;   // its own wgmma_wait came first
        for (int u = wg * kWarpgroupThreads; !ordered && u < (wg + 1) * kWarpgroupThreads; ++u)
            ordered = handed_on(u, writer, op.retired);
        if (!ordered)
            fail_in_fiber(format("racecheck: %s writes %s, which the wgmma at %s:%d of %s reads, with no mbarrier "
                                 "hand-off from that warpgroup after the wgmma_wait that retired it (a stage released "
                                 "before the wgmma_wait that retires the wgmmas reading it)",
                                 writer_name(file, line, pc).c_str(),
                                 shared_place(a).c_str(), op.file, op.line, warpgroup_name(wg).c_str()));
        if (verified) verified[wg] = serial;
    }
    if (!verified) {
        for (std::uint32_t& serial : hw.wgmma) serial = 0;
        unmark_word(g_shadow[idx], kWgmmaWord);
    }
}

// hopper_access (declared above shared_shadow): a plain access of thread t to a marked word.
void hopper_access(int t, ShadowWord* s, std::uintptr_t a, int how, const SharedVariable& v, const void* pc) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    const std::size_t idx = std::size_t(s - g_shadow.data());
    HopperWord& hw = g_hopper_words[idx];
    const auto place = [&] { return format("byte %ld of `%s`", long(a - v.begin), v.name.c_str()); };
    if (s->hopper & kMbarrierWord) {
        const MBarrier& b = h.barriers[hw.barrier - 1];
        fail_in_fiber(format("synccheck: %s %s, part of the mbarrier initialised at %s:%d: a plain %s of an "
                             "mbarrier's bytes (only the mbarrier_* wrappers may touch them)%s", verb(how),
                             place().c_str(), b.init_file, b.init_line, how == WRITE ? "store" : "load",
                             at(pc).c_str()));
    }
    if (s->hopper & kTmaWord) {
        const TmaLoad& load = h.tmas[hw.tma - 1];
        if (!handed_on(s->writer, t, s->w_gen))
            fail_in_fiber(format("initcheck: %s %s, which the TMA load at %s:%d writes, before this thread observed "
                                 "the completion of phase %u of %s that its bytes complete (mbarrier_wait(bar, %u))%s",
                                 verb(how), place().c_str(), load.file, load.line, load.phase,
                                 barrier_name(h.barriers[std::size_t(load.barrier)]).c_str(), load.phase & 1,
                                 at(pc).c_str()));
        if (how == WRITE) {
            hw.tma = 0;
            unmark_word(*s, kTmaWord);
        }
    }
    if ((s->hopper & kWgmmaWord) && how == WRITE)
        check_wgmma_readers(t, a, nullptr, 0, pc, nullptr);
}

// ---- TMA
// The write of the word at a by TMA load `load` (issued by thread p; the barrier's agent slot `agent`): checked
// against what the word holds, as thread p's write, then marked as the load's.
void tma_write_word(std::uintptr_t a, const TmaLoad& load, std::uint32_t index, int agent, std::uint32_t* verified) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    const int p = load.issuer;
    const std::size_t idx = word_index(a);
    ShadowWord& s = g_shadow[idx];
    HopperWord& hw = g_hopper_words[idx];
    const std::uint32_t start = g.block_start, phase = g.phase;
    const auto what = [&] { return format("the TMA load at %s:%d", load.file, load.line); };
    if ((s.pending & ~kHopperMarked) >= start && (s.pending & ~kHopperMarked))
        fail_in_fiber(format("racecheck: %s writes %s while a cp.async to it is in flight", what().c_str(),
                             shared_place(a).c_str()));
    if (s.hopper & kMbarrierWord)
        fail_in_fiber(format("synccheck: %s writes %s, part of %s (initialised at %s:%d)", what().c_str(),
                             shared_place(a).c_str(), barrier_name(h.barriers[hw.barrier - 1]).c_str(),
                             h.barriers[hw.barrier - 1].init_file, h.barriers[hw.barrier - 1].init_line));
    if (s.hopper & kWgmmaWord) check_wgmma_readers(p, a, load.file, load.line, nullptr, verified);
    const bool written = s.w_phase >= start && s.w_phase;
    if ((s.hopper & kTmaWord) && written && !handed_on(s.writer, p, s.w_gen)) {
        const TmaLoad& before = h.tmas[hw.tma - 1];
        fail_in_fiber(format("racecheck: %s overwrites %s, which the TMA load at %s:%d wrote, before this thread "
                             "observed phase %u of %s that those bytes complete: the stage is not free yet",
                             what().c_str(), shared_place(a).c_str(), before.file, before.line, before.phase,
                             barrier_name(h.barriers[std::size_t(before.barrier)]).c_str()));
    }
    if (!(s.hopper & kTmaWord) && written && s.w_phase == phase && s.writer != p && !warp_synced(s.writer, p, s.w_gen) &&
        !handed_on(s.writer, p, s.w_gen))
        fail_in_fiber(format("racecheck: %s overwrites %s, which %s wrote, with no __syncthreads() or mbarrier hand-off "
                             "between them", what().c_str(), shared_place(a).c_str(), thread_name(s.writer).c_str()));
    for (int r = 0; s.r_phase == phase && r < s.readers; ++r)
        if (s.reader[r] != p && !warp_synced(s.reader[r], p, s.r_gen[r]) && !handed_on(s.reader[r], p, s.r_gen[r]))
            fail_in_fiber(format("racecheck: %s overwrites %s, which %s read, with no __syncthreads() or mbarrier "
                                 "hand-off between them", what().c_str(), shared_place(a).c_str(),
                                 thread_name(s.reader[r]).c_str()));
    for (std::uint32_t& serial : hw.wgmma) serial = 0;
    unmark_word(s, kWgmmaWord);
    s.w_phase = phase, s.w_gen = load.time, s.writer = std::uint16_t(agent);
    s.r_phase = 0;
    hw.tma = index;
    mark_word(idx, kTmaWord);
}

// ---- warpgroups
std::string warpgroup_op_name(const WarpgroupCall& c) {
    switch (c.op) {
        case WG_FENCE: return "wgmma_fence";
        case WG_COMMIT: return "wgmma_commit";
        case WG_WAIT: return format("wgmma_wait<%d>", c.arg);
        case WG_MMA: return format("wgmma_%s<%d>", c.tf32 ? "tf32" : "bf16", c.n);
        default: return format("setmaxnreg_%s<%d>", c.accumulate ? "inc" : "dec", c.arg);
    }
}

std::string warpgroup_call_name(const WarpgroupCall& c) {
    return format("%s at %s:%d", warpgroup_op_name(c).c_str(), c.file, c.line);
}

// Whether two threads' calls are one call instance: the same chain of return addresses or, where the compiler copied
// the code (into the two sides of a branch, say), of the same places of the source; a module without the sanitizer
// has no line table to tell, and the call's own source line has to do.
bool same_instance(const WarpgroupCall& a, const WarpgroupCall& b) {
    if (a.op != b.op) return false;
    if (a.path == b.path) return true;
    if (a.line != b.line || std::strcmp(a.file, b.file) != 0) return false;
    return !g_launch->sanitize || same_source_calls(a.chain, b.chain);
}

Accumulator* accumulator_of(HopperThread& t, const float* d) {
    for (Accumulator& acc : t.acc)
        if (acc.d == d) return &acc;
    return nullptr;
}

bool holds(const float* d, int count, const float* values) {
    return std::memcmp(d, values, sizeof(float) * std::size_t(count)) == 0;
}

// The poison a wgmma's accumulators hold until their wait: one tag a call site (see poison).
std::uint32_t wgmma_poison(const WarpgroupCall& c) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    const auto key = std::make_pair(std::string(c.file), c.line);
    auto found = h.poison_tags.find(key);
    if (found == h.poison_tags.end()) {
        if (g.undefined.size() == std::size_t(1) << kPoisonTagBits)
            fail_in_fiber(format("%s: more undefined values in this launch than the emulator tells apart (%zu)",
                                 warpgroup_call_name(c).c_str(), g.undefined.size()));
        g.undefined.push_back({nullptr, format("the accumulators of the %s, undefined until the wgmma_wait that "
                                               "retires it (wgmma.mma_async is asynchronous: wgmma_commit(), then "
                                               "wgmma_wait<N>(), before they are read or written)",
                                               warpgroup_call_name(c).c_str())});
        g_check_values = g.sanitize != 0;
        found = h.poison_tags.emplace(key, g.undefined.size() - 1).first;
    }
    return std::uint32_t(poison(found->second, 4));
}

// The shared address a descriptor's element (row r, k) is at: K-major, the 16-byte chunks of each row swizzled
// by the layout's pattern (sm90.cuh; CUTLASS's canonical GMMA K-major layouts); MN-major (a transposed operand,
// 128-byte swizzle), the 16-byte chunk of 8 rows at one k (mn_chunk; CUTLASS's Layout_MN_SW128_Atom: lines of 64
// rows along m or n, 128 bytes, at consecutive k; groups of 8 k SBO apart; the next 64 rows LBO further).
struct Descriptor {
    std::uint32_t start, lbo, sbo, base;
    int mode;   // 0 none (interleave), 1 128-byte swizzle, 2 64-byte, 3 32-byte
    explicit Descriptor(std::uint64_t d)
        : start(std::uint32_t(d & 0x3fff) << 4), lbo(std::uint32_t(d >> 16 & 0x3fff) << 4),
          sbo(std::uint32_t(d >> 32 & 0x3fff) << 4), base(std::uint32_t(d >> 49 & 7)), mode(int(d >> 62)) {}
    // the shared address of the 16-byte chunk `chunk` (k 8 chunk ..) of row r
    std::uint32_t chunk(int r, int chunk_) const {
        static const std::uint32_t pitch[4] = {16, 128, 64, 32}, bits[4] = {0, 3, 2, 1};
        std::uint32_t a = start + std::uint32_t(r / 8) * sbo + std::uint32_t(r % 8) * pitch[mode] +
                          std::uint32_t(chunk_) * (mode == 0 ? lbo : 16);
        return a ^ ((a >> 7) & ((1u << bits[mode]) - 1)) << 4;
    }
    // the shared address of the 16-byte chunk of rows 8 row8 .. 8 row8 + 7 at k (128-byte swizzle)
    std::uint32_t mn_chunk(int row8, int k) const {
        const std::uint32_t a = start + std::uint32_t(row8 / 8) * lbo + std::uint32_t(k / 8) * sbo +
                                std::uint32_t(k % 8) * 128 + std::uint32_t(row8 % 8) * 16;
        return a ^ ((a >> 7) & 7) << 4;
    }
};

struct OrderMemo {   // the last writer whose word a wgmma found ordered before it
    int writer = -1;
    std::uint32_t gen = 0, phase = 0;
};

// Under the full sanitizer, the checks of warpgroup wg's wgmma `c` (serial `serial`) reading the shared word at a:
// initialised, not a cp.async's in flight nor an mbarrier's; a TMA load's bytes observed by every thread of the
// warpgroup; a plain store's followed by fence_proxy_async() in the thread that made it, and ordered before the
// warpgroup's threads. Then marked as read by the wgmma (kWgmmaWord).
void wgmma_read_word(std::uintptr_t a, int wg, std::uint32_t serial, const WarpgroupCall& c, OrderMemo& memo) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    const std::size_t idx = word_index(a);
    ShadowWord& s = g_shadow[idx];
    HopperWord& hw = g_hopper_words[idx];
    const std::uint32_t start = g.block_start;
    const int first = wg * kWarpgroupThreads;
    if ((s.pending & ~kHopperMarked) >= start && (s.pending & ~kHopperMarked))
        fail_for(first, format("initcheck: the %s reads %s while a cp.async to it is in flight",
                               warpgroup_call_name(c).c_str(), shared_place(a).c_str()));
    if (s.hopper & kMbarrierWord)
        fail_for(first, format("synccheck: the %s reads %s, part of the mbarrier initialised at %s:%d",
                               warpgroup_call_name(c).c_str(), shared_place(a).c_str(),
                               h.barriers[hw.barrier - 1].init_file, h.barriers[hw.barrier - 1].init_line));
    if (!(s.w_phase >= start && s.w_phase))
        fail_for(first, format("initcheck: the %s reads %s, which no thread of the block (nor a TMA load) has written",
                               warpgroup_call_name(c).c_str(), shared_place(a).c_str()));
    if (!(memo.writer == s.writer && memo.gen == s.w_gen && memo.phase == s.w_phase)) {
        const int w = s.writer;
        if (w >= h.first_agent && hw.tma) {   // a TMA load's bytes
            const TmaLoad& load = h.tmas[hw.tma - 1];
            for (int u = first; u < first + kWarpgroupThreads; ++u)
                if (!handed_on(w, u, s.w_gen))
                    fail_for(u, format("initcheck: the %s reads %s, which the TMA load at %s:%d writes, before this "
                                       "thread observed the completion of phase %u of %s that its bytes complete "
                                       "(every thread of the warpgroup waits for it: mbarrier_wait(bar, %u))",
                                       warpgroup_call_name(c).c_str(), shared_place(a).c_str(), load.file, load.line,
                                       load.phase, barrier_name(h.barriers[std::size_t(load.barrier)]).c_str(),
                                       load.phase & 1));
        } else if (w < h.threads) {   // a plain store's, of thread w
            if (h.thread[std::size_t(w)].proxy_fence <= s.w_gen)
                fail_for(first, format("racecheck: the %s reads %s, which %s wrote with a plain store (the generic "
                                       "proxy) and did not follow with fence_proxy_async() before the wgmma (the async "
                                       "proxy) reads it", warpgroup_call_name(c).c_str(), shared_place(a).c_str(),
                                       thread_name(w).c_str()));
            if (s.w_phase == g.phase)
                for (int u = first; u < first + kWarpgroupThreads; ++u)
                    if (u != w && !warp_synced(w, u, s.w_gen) && !handed_on(w, u, s.w_gen))
                        fail_for(u, format("racecheck: the %s reads %s, which %s wrote, with no __syncthreads() or "
                                           "mbarrier hand-off between the store and this thread's wgmma",
                                           warpgroup_call_name(c).c_str(), shared_place(a).c_str(),
                                           thread_name(w).c_str()));
        }
        memo.writer = s.writer, memo.gen = s.w_gen, memo.phase = s.w_phase;
    }
    hw.wgmma[wg] = serial;
    mark_word(idx, kWgmmaWord);
}

// Reads `rows` rows of 16 bf16 (k), or of 8 TF32 (wgmma_tf32: a float32's top 19 bits, the low 13 ignored as the
// tensor cores ignore them), of a wgmma operand through its descriptor into out (rows x 16 doubles, the first 8 of
// each row TF32's).
void read_operand(std::uint64_t desc, int rows, const char* which, int wg, std::uint32_t serial,
                  const WarpgroupCall& c, double* out) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    const Descriptor d(desc);
    const int first = wg * kWarpgroupThreads;
    const bool mn_major = c.arg != 0;
    if (d.base)
        fail_for(first, format("%s: its %s descriptor 0x%016llx has base offset %u, which the emulator does not "
                               "model: keep the operands' swizzle patterns 1024-byte aligned (base offset 0)",
                               warpgroup_call_name(c).c_str(), which, static_cast<unsigned long long>(desc), d.base));
    if (mn_major && d.mode != 1)
        fail_for(first, format("%s: its %s operand is MN-major with descriptor 0x%016llx of swizzle mode %d: the "
                               "emulator runs MN-major operands of the 128-byte swizzle (mode 1) only",
                               warpgroup_call_name(c).c_str(), which, static_cast<unsigned long long>(desc), d.mode));
    OrderMemo memo;
    // K-major: rows r, each two chunks of 8 k; MN-major: k (the first index), each rows / 8 chunks of 8 rows
    for (int r = 0; r < (mn_major ? 16 : rows); ++r)
        for (int chunk = 0; chunk < (mn_major ? rows / 8 : 2); ++chunk) {
            const std::uint32_t address = mn_major ? d.mn_chunk(chunk, r) : d.chunk(r, chunk);
            const std::uintptr_t p = from_window(address);
            if (!shared_variable(p, 16))
                fail_for(first, format("memcheck: the %s reads %s %d, %s %d..%d of its %s operand (descriptor "
                                       "0x%016llx) at shared address 0x%x: %s", warpgroup_call_name(c).c_str(),
                                       mn_major ? "k" : "row", r, mn_major ? "rows" : "k", 8 * chunk, 8 * chunk + 7,
                                       which, static_cast<unsigned long long>(desc), address,
                                       shared_variable(p, 1) ? ("16 bytes at " + shared_place(p) + " run past its end").c_str()
                                                             : "not in a __shared__ variable of the kernel nor in the "
                                                               "dynamic shared memory the launch asked for"));
            if (h.clocks)
                for (int k = 0; k < 16; k += 4) wgmma_read_word(p + std::uintptr_t(k), wg, serial, c, memo);
            if (c.tf32) {   // K-major: 4 k a chunk
                std::uint32_t words[4];
                std::memcpy(words, reinterpret_cast<const void*>(p), 16);
                for (int e = 0; e < 4; ++e)
                    out[r * 16 + 4 * chunk + e] = double(emu::from_bits<float>(words[e] & 0xffffe000u));
                continue;
            }
            unsigned short bits[8];
            std::memcpy(bits, reinterpret_cast<const void*>(p), 16);
            for (int e = 0; e < 8; ++e) {   // out: rows x 16 k
                const std::uint32_t wide = std::uint32_t(bits[e]) << 16;
                out[mn_major ? (8 * chunk + e) * 16 + r : r * 16 + 8 * chunk + e] = double(emu::from_bits<float>(wide));
            }
        }
}

// wgmma.mma_async m64nNk16 f32.bf16.bf16 (m64nNk8 f32.tf32.tf32) of warpgroup wg: d = A B (+ d), each element the
// exact sum of its 16 (8) products and its accumulator, rounded once (as emu_mma); the result pending until the wait
// of its group.
void execute_wgmma(int wg) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    Warpgroup& W = h.warpgroups[std::size_t(wg)];
    const int first = wg * kWarpgroupThreads;
    const WarpgroupCall& c = W.call[0];
    const int n = c.n, count = n / 2;
    for (int u = 1; u < kWarpgroupThreads; ++u) {
        const WarpgroupCall& other = W.call[u];
        if (other.n != n || other.a != c.a || other.b != c.b || (other.accumulate != 0) != (c.accumulate != 0) ||
            other.arg != c.arg || other.tf32 != c.tf32)
            fail_for(first + u, format("synccheck: %s with operands other than %s's (descriptors 0x%016llx and "
                                       "0x%016llx, accumulate %d against 0x%016llx, 0x%016llx, %d; or its operands' "
                                       "majors): a wgmma's descriptors, scale-d and transposes are the warpgroup's, the "
                                       "same in each thread",
                                       warpgroup_call_name(other).c_str(), thread_name(first).c_str(),
                                       static_cast<unsigned long long>(other.a), static_cast<unsigned long long>(other.b),
                                       other.accumulate, static_cast<unsigned long long>(c.a),
                                       static_cast<unsigned long long>(c.b), c.accumulate));
    }
    // each thread's accumulators: wgmma_fence since they were last written, and what they add
    static thread_local std::vector<float> inputs;
    inputs.assign(std::size_t(kWarpgroupThreads) * std::size_t(count), 0.0f);
    for (int u = 0; u < kWarpgroupThreads; ++u) {
        HopperThread& t = h.thread[std::size_t(first + u)];
        const WarpgroupCall& call = W.call[u];
        Accumulator* acc = accumulator_of(t, call.d);
        if (acc && acc->pending) {
            if (acc->n != n)
                fail_for(first + u, format("synccheck: %s on accumulators that the pending wgmma of N = %d at %s:%d "
                                           "writes: chained wgmmas need one shape", warpgroup_call_name(call).c_str(),
                                           acc->n, acc->file, acc->line));
            for (int k = 0; k < count; ++k)
                if (emu::to_bits(call.d[k]) != acc->poison)
                    fail_for(first + u, format("racecheck: d[%d], an accumulator of the wgmma at %s:%d, written "
                                               "before its wgmma.wait_group (the %s chains on it): a wgmma writes its "
                                               "accumulators asynchronously until the wgmma_wait that retires it", k,
                                               acc->file, acc->line, warpgroup_call_name(call).c_str()));
        } else if (acc) {
            if ((acc->n != n || !holds(call.d, count, acc->values)) && t.wgmma_fence <= acc->retired)
                fail_for(first + u, format("synccheck: %s writes accumulators that the thread wrote after the "
                                           "wgmma_wait that retired them, with no wgmma_fence() since (wgmma.fence "
                                           "orders a thread's own accesses of the accumulators before the wgmma)",
                                           warpgroup_call_name(call).c_str()));
        } else if (t.wgmma_fence <= t.last_wait) {
            fail_for(first + u, format("synccheck: %s writes accumulators with no wgmma_fence() by the thread before it "
                                       "(since its last wgmma_wait, or its start): wgmma.fence comes before the first "
                                       "wgmma, after the thread's own accesses of the accumulators",
                                       warpgroup_call_name(call).c_str()));
        }
        if (!c.accumulate) continue;
        float* in = inputs.data() + std::size_t(u) * std::size_t(count);
        for (int k = 0; k < count; ++k) {
            in[k] = acc && acc->pending ? acc->values[k] : call.d[k];
            const int tag = poison_tag(emu::to_bits(in[k]), 4);
            if (tag >= 0)
                fail_for(first + u, format("initcheck: %s accumulates onto d[%d], an undefined value: %s",
                                           warpgroup_call_name(call).c_str(), k,
                                           g.undefined[std::size_t(tag)].what.c_str()));
        }
    }
    W.ops.push_back({0, 0, c.file, c.line});
    const auto serial = std::uint32_t(W.ops.size());
    h.a.resize(64 * 16);
    h.b.resize(std::size_t(n) * 16);
    read_operand(c.a, 64, "A", wg, serial, c, h.a.data());
    read_operand(c.b, n, "B", wg, serial, c, h.b.data());
    const std::uint32_t poison_bits = wgmma_poison(c);
    for (int u = 0; u < kWarpgroupThreads; ++u) {
        HopperThread& t = h.thread[std::size_t(first + u)];
        const WarpgroupCall& call = W.call[u];
        Accumulator* acc = accumulator_of(t, call.d);
        if (!acc) {
            t.acc.push_back(Accumulator{});
            acc = &t.acc.back();
            acc->d = call.d;
        }
        const int w = u / 32, l = u % 32;
        const float* in = inputs.data() + std::size_t(u) * std::size_t(count);
        for (int j = 0; j < n / 8; ++j)
            for (int i = 0; i < 4; ++i) {
                const int row = 16 * w + l / 4 + 8 * (i / 2), col = 8 * j + 2 * (l % 4) + i % 2;
                double sum = c.accumulate ? double(in[4 * j + i]) : 0.0;   // the products are exact
                for (int k = 0; k < (c.tf32 ? 8 : 16); ++k)
                    sum += h.a[std::size_t(row) * 16 + k] * h.b[std::size_t(col) * 16 + k];
                acc->values[4 * j + i] = float(sum);
            }
        acc->n = n;
        acc->pending = true;
        acc->group = 0;
        acc->poison = poison_bits;
        acc->file = c.file;
        acc->line = c.line;
        for (int k = 0; k < count; ++k) call.d[k] = emu::from_bits<float>(poison_bits);
    }
}

void execute_commit(int wg) {
    Hopper& h = *g_launch->hopper;
    Warpgroup& W = h.warpgroups[std::size_t(wg)];
    const std::uint32_t group = ++W.groups;
    for (WgmmaOp& op : W.ops)
        if (!op.group) op.group = group;
    for (int u = 0; u < kWarpgroupThreads; ++u)
        for (Accumulator& acc : h.thread[std::size_t(wg * kWarpgroupThreads + u)].acc)
            if (acc.pending && !acc.group) acc.group = group;
}

void execute_wait(int wg) {
    Hopper& h = *g_launch->hopper;
    Warpgroup& W = h.warpgroups[std::size_t(wg)];
    const int first = wg * kWarpgroupThreads;
    const WarpgroupCall& c = W.call[0];
    const std::uint32_t keep = std::uint32_t(std::max(0, c.arg));
    const std::uint32_t last = W.groups > keep ? W.groups - keep : 0;   // the groups retired: 1..last
    const std::uint32_t time = tick();
    for (WgmmaOp& op : W.ops)
        if (op.group && op.group <= last && !op.retired) op.retired = time;
    for (int u = 0; u < kWarpgroupThreads; ++u) {
        HopperThread& t = h.thread[std::size_t(first + u)];
        t.last_wait = time;
        for (Accumulator& acc : t.acc) {
            if (!acc.pending || !acc.group || acc.group > last) continue;
            const int count = acc.n / 2;
            for (int k = 0; k < count; ++k)
                if (emu::to_bits(acc.d[k]) != acc.poison)
                    fail_for(first + u, format("racecheck: d[%d], an accumulator of the wgmma at %s:%d, written before "
                                               "its wgmma.wait_group (the %s): a wgmma writes its accumulators "
                                               "asynchronously until the wait that retires it", k, acc.file, acc.line,
                                               warpgroup_call_name(W.call[u]).c_str()));
            std::memcpy(acc.d, acc.values, sizeof(float) * std::size_t(count));
            acc.pending = false;
            acc.retired = time;
        }
    }
}

// Executes the instruction that every thread of warpgroup wg waits in (checked alike on arrival).
void execute_warpgroup(int wg) {
    Hopper& h = *g_launch->hopper;
    Warpgroup& W = h.warpgroups[std::size_t(wg)];
    const WarpgroupCall& c = W.call[0];
    for (int u = 1; u < kWarpgroupThreads; ++u)
        if (W.call[u].arg != c.arg || (c.op == WG_SETMAXNREG && W.call[u].accumulate != c.accumulate))
            fail_for(wg * kWarpgroupThreads + u,
                     format("synccheck: %s while %s executes %s: the operand of a warpgroup-wide instruction is the "
                            "warpgroup's", warpgroup_call_name(W.call[u]).c_str(),
                            thread_name(wg * kWarpgroupThreads).c_str(), warpgroup_op_name(c).c_str()));
    switch (c.op) {
        case WG_FENCE: {
            const std::uint32_t time = tick();
            for (int u = 0; u < kWarpgroupThreads; ++u) h.thread[std::size_t(wg * kWarpgroupThreads + u)].wgmma_fence = time;
            break;
        }
        case WG_COMMIT: execute_commit(wg); break;
        case WG_WAIT: execute_wait(wg); break;
        case WG_MMA: execute_wgmma(wg); break;
        default: break;   // setmaxnreg: the registers are not modelled
    }
}

// Completes warpgroup wg's instruction once all its threads wait in it; threads that returned make it an error,
// once every other thread has arrived (so that the message does not depend on the order the threads run in).
void try_complete_warpgroup(int wg) {
    Launch& g = *g_launch;
    Hopper& h = *g.hopper;
    Warpgroup& W = h.warpgroups[std::size_t(wg)];
    const int first = wg * kWarpgroupThreads;
    std::vector<int> returned;
    for (int u = first; u < first + kWarpgroupThreads; ++u)
        if (g.state[std::size_t(u)] == RETURNED) returned.push_back(u);
    if (!W.arrived || W.arrived + int(returned.size()) < kWarpgroupThreads) return;
    if (!returned.empty()) {
        fail(describe_thread(W.first) +
             format(": synccheck: %s with %s of its warpgroup returned: all 128 threads of %s must execute it",
                    warpgroup_call_name(W.call[W.first - first]).c_str(), thread_list(returned).c_str(),
                    warpgroup_name(wg).c_str()));
        return;
    }
    execute_warpgroup(wg);   // W.call[u]: thread first + u's
    W.arrived = 0;
    W.first = -1;
    for (int u = first; u < first + kWarpgroupThreads; ++u) g.state[std::size_t(u)] = RUNNABLE;
}

// The running thread arrives at a warpgroup-wide instruction (`call`, its path from the runtime's `frame`).
void warpgroup_instruction(WarpgroupCall& call, void* frame) {
    Launch& g = *g_launch;
    Hopper& h = hopper();
    const int i = g.current, wg = i / kWarpgroupThreads;
    if ((wg + 1) * kWarpgroupThreads > g.threads)
        fail_in_fiber(format("synccheck: %s needs the 128 threads of %s, and the block has %d",
                             warpgroup_call_name(call).c_str(), warpgroup_name(wg).c_str(), g.threads));
    const void* innermost;
    call.chain.n = 0;
    call.path = call_path(frame, &innermost, 0, nullptr, &call.chain);
    Warpgroup& W = h.warpgroups[std::size_t(wg)];
    if (W.arrived && !same_instance(call, W.call[W.first % kWarpgroupThreads]))
        fail_in_fiber(format("synccheck: reached %s while %s of its warpgroup waits in %s: a warpgroup-wide .aligned "
                             "instruction needs all 128 threads of %s at the same call",
                             warpgroup_call_name(call).c_str(), thread_name(W.first).c_str(),
                             warpgroup_call_name(W.call[W.first % kWarpgroupThreads]).c_str(),
                             warpgroup_name(wg).c_str()));
    W.call[i % kWarpgroupThreads] = call;
    if (!W.arrived) W.first = i;
    ++W.arrived;
    g.state[std::size_t(i)] = AT_WARPGROUP;
    try_complete_warpgroup(wg);
    switch_to_scheduler(i);
}

// What a returning thread leaves behind: wgmmas not retired are an error; its warpgroup's threads waiting in an
// instruction now wait for ever (try_complete_warpgroup says so).
void hopper_thread_returns(int i) {
    Hopper& h = *g_launch->hopper;
    for (const Accumulator& acc : h.thread[std::size_t(i)].acc)
        if (acc.pending)
            fail_in_fiber(format("synccheck: returned with the wgmma at %s:%d %s: wgmma_commit(), then wgmma_wait<0>() "
                                 "before the thread ends", acc.file, acc.line,
                                 acc.group ? "committed but never retired (wgmma_wait)"
                                           : "never committed (wgmma_commit) nor retired (wgmma_wait)"));
}

void hopper_after_return(int i) {
    Hopper& h = *g_launch->hopper;
    const int wg = i / kWarpgroupThreads;
    if (std::size_t(wg) < h.warpgroups.size() && h.warpgroups[std::size_t(wg)].arrived) try_complete_warpgroup(wg);
}

// For a deadlock's message: the threads waiting for mbarriers and in warpgroup instructions.
std::string describe_hopper_waits() {
    const Launch& g = *g_launch;
    const Hopper& h = *g.hopper;
    std::string s;
    for (int id = 1; id < 16; ++id) {
        const Launch::Named& b = g.named[id];
        if (!b.arrived) continue;
        std::vector<int> waiting;
        for (int t = 0; t < g.threads; ++t)
            if (g.state[std::size_t(t)] == AT_NAMED && g.named_id[std::size_t(t)] == id) waiting.push_back(t);
        s += format("; named barrier %d (%s:%d): %s wait for %d threads, %d of them arrived", id, b.file, b.line,
                    thread_list(waiting).c_str(), b.expected, b.arrived);
    }
    for (const MBarrier& b : h.barriers) {
        if (b.waiters.empty()) continue;
        std::map<std::tuple<std::string, int, unsigned>, std::vector<int>> by_call;
        for (const int w : b.waiters) {
            const HopperThread& t = h.thread[std::size_t(w)];
            by_call[{t.wait_file, t.wait_line, t.wait_parity}].push_back(w);
        }
        s += format("; %s (%s)", barrier_name(b).c_str(), barrier_state(b).c_str());
        for (const auto& [call, threads] : by_call)
            s += format(": %s wait at %s:%d for its phase of parity %u to complete", thread_list(threads).c_str(),
                        std::get<0>(call).c_str(), std::get<1>(call), std::get<2>(call));
    }
    for (std::size_t wg = 0; wg < h.warpgroups.size(); ++wg) {
        const Warpgroup& W = h.warpgroups[wg];
        if (!W.arrived) continue;
        std::vector<int> waiting, missing;
        const int first = int(wg) * kWarpgroupThreads;
        for (int u = first; u < std::min(g.threads, first + kWarpgroupThreads); ++u)
            (g.state[std::size_t(u)] == AT_WARPGROUP ? waiting : missing).push_back(u);
        s += format("; warpgroup %zu: %s wait in %s for %s", wg, thread_list(waiting).c_str(),
                    warpgroup_call_name(W.call[W.first - first]).c_str(), thread_list(missing).c_str());
    }
    return s;
}

// At a block's end: no transactions pending on its barriers.
bool hopper_block_ends() {
    Launch& g = *g_launch;
    for (const MBarrier& b : g.hopper->barriers)
        if (b.tx != 0) {
            fail(format("synccheck: block (%u,%u,%u) ended with %lld transaction bytes pending on %s (%s): %s",
                        g.block_idx.x, g.block_idx.y, g.block_idx.z, b.tx, barrier_name(b).c_str(),
                        barrier_state(b).c_str(),
                        b.tx > 0 ? "mbarrier_arrive_expect_tx expected more bytes than the TMA loads on it delivered"
                                 : "TMA loads delivered bytes that no mbarrier_arrive_expect_tx expected"));
            return false;
        }
    return true;
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
    if (g.hopper) s += describe_hopper_waits();
    return s;
}

// synccheck: the threads a barrier releases must wait at one call instance.
bool barrier_converged() {
    Launch& g = *g_launch;
    int first = -1;
    for (int i = 0; i < g.threads; ++i) {
        if (g.state[i] != AT_BARRIER) continue;
        if (first < 0) {
            first = i;
        } else if (g.barrier_path[i] != g.barrier_path[first]) {
            const auto [first_file, first_line] = g.barrier_site[first];
            const auto [file, line] = g.barrier_site[i];
            if (file == first_file && line == first_line && same_source_calls(g.barrier_calls[i], g.barrier_calls[first]))
                continue;   // one barrier of the source, whose calls the compiler copied
            fail(format("synccheck: %s waits at a __syncthreads() at %s:%d and %s at another at %s:%d%s: a barrier "
                        "that part of the block skips (a barrier in divergent code) releases the wrong threads",
                        describe_thread(first).c_str(), first_file, first_line, thread_name(i).c_str(), file, line,
                        first_file == file && first_line == line ? " (the same line, reached through other calls)"
                                                                   : ""));
            return false;
        }
    }
    return true;
}

void release_barrier() {
    Launch& g = *g_launch;
    g.phase = ++g_phase;
    for (Warp& w : g.warps) w.syncs.clear();
    if (g_clocks) join_block_clocks();
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
    for (Warp& w : g.warps) {
        w.returned = w.waiting = 0;
        w.syncs.clear();
    }
    g.block_start = g.phase = ++g_phase;
    g.block_fence = 0;
    if (g.hopper) reset_hopper_block(*g.hopper);
    g.acquiring.clear();
    g.acquired.clear();
    const int last = g.threads - (int(g.warps.size()) - 1) * 32;
    if (last < 32) g.warps.back().returned = ~0u << last;  // lanes that do not exist
    g.live = g.threads;
    g.at_barrier = 0;
    g.barrier_sum = 0;
    g.barrier_and = 1;
    g.barrier_or = 0;
    for (Launch::Named& b : g.named) b = {0, 0, 0, nullptr, 0};
    g.named_id.assign(std::size_t(g.threads), 0);
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
            if (g.failed || (!g.racing.empty() && !check_racing_stores())) return false;
            if (g.unchecked.n) {   // the thread's last store, before the thread's turn ended
                const std::string error = undefined_store();
                if (!error.empty()) {
                    fail(describe_thread(i) + ": " + error);
                    return false;
                }
            }
            ran = true;
        }
        if (g.live == 0) break;
        if (g.at_barrier == g.live) {
            if (g.sanitize && !barrier_converged()) return false;
            release_barrier();
            continue;
        }
        if (!ran) {
            fail(describe_deadlock());
            return false;
        }
    }
    if (g.hopper && !hopper_block_ends()) return false;
    if (!dynamic_shared_tail_intact()) {
        fail(format("block (%u,%u,%u) wrote past the %zu bytes of dynamic shared memory the launch asked for",
                    block_idx.x, block_idx.y, block_idx.z, g.dynamic_bytes));
        return false;
    }
    if (g.traffic) g.traffic->end_block();
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
    if (g.hopper) hopper_thread_returns(i);
    g.state[i] = RETURNED;
    --g.live;
    g.warps[i / 32].returned |= 1u << (i % 32);
    release_warp_after_return(i / 32);
    if (g.hopper) hopper_after_return(i);
    switch_to_scheduler(i);
    std::abort();  // a returned fiber is never resumed
}

namespace {
// A named barrier whose count of threads arrived: bar.sync is .aligned, so every lane of a warp that has not returned
// must be among them; they are released, each having released to the others what it did before (the vector clocks,
// under the full sanitizer), and with every thread that has not returned among them, racecheck's phase ends as at a
// __syncthreads().
void release_named(int id) {
    Launch& g = *g_launch;
    Launch::Named& b = g.named[id];
    const auto at = [&](int t) { return g.state[std::size_t(t)] == AT_NAMED && g.named_id[std::size_t(t)] == id; };
    for (std::size_t wi = 0; wi < g.warps.size(); ++wi) {
        unsigned waiting = 0;
        for (int lane = 0; lane < 32 && int(wi) * 32 + lane < g.threads; ++lane)
            if (at(int(wi) * 32 + lane)) waiting |= 1u << lane;
        const unsigned live = ~g.warps[wi].returned;
        if (waiting && (waiting & live) != live)
            fail_in_fiber(format("synccheck: named barrier %d (%s:%d) has its %d threads, lanes %s of warp %zu among "
                                 "them, while lanes %s of that warp are elsewhere: every lane of a warp that has not "
                                 "returned waits at a named barrier together (bar.sync is .aligned)", id, b.file, b.line,
                                 b.expected, lane_list(waiting).c_str(), wi, lane_list(live & ~waiting).c_str()));
    }
    std::vector<int> participants;
    for (int t = 0; t < g.threads; ++t)
        if (at(t)) participants.push_back(t);
    if (g_clocks) join_thread_clocks(participants);
    for (const int t : participants) {
        g.state[std::size_t(t)] = RUNNABLE;
        g.barrier_result[std::size_t(t)] = b.any;
    }
    if (int(participants.size()) == g.live) {
        g.phase = ++g_phase;
        for (Warp& w : g.warps) w.syncs.clear();
    }
    b = {0, 0, 0, nullptr, 0};
}
}  // namespace

// sm90.cuh's named_barrier_sync / named_barrier_any: bar.sync (bar.red.or) `id` (1..15) for `threads` threads (a
// multiple of 32), returning whether any of them passed a predicate that is not 0.
extern "C" int emu_named_barrier(int id, int threads, int predicate, const char* file, int line) {
    Launch& g = *g_launch;
    const int i = g.current;
    if (id < 1 || id > 15)
        fail_in_fiber(format("synccheck: a named barrier at %s:%d of id %d: its ids are 1 to 15 (0 is "
                             "__syncthreads()'s)", file, line, id));
    const int most = (g.threads + 31) / 32 * 32;
    if (threads < 32 || threads % 32 || threads > most)
        fail_in_fiber(format("synccheck: named barrier %d at %s:%d for %d threads: a multiple of 32 from 32 to the "
                             "block's %d", id, file, line, threads, most));
    hopper();   // its vector clocks (the full sanitizer) order what the barrier's threads did
    Launch::Named& b = g.named[id];
    if (b.arrived && b.expected != threads)
        fail_in_fiber(format("synccheck: named barrier %d at %s:%d for %d threads, while %d threads wait at it for %d "
                             "(at %s:%d)", id, file, line, threads, b.arrived, b.expected, b.file, b.line));
    if (!b.arrived) b = {threads, 0, 0, file, line};
    ++b.arrived;
    b.any |= predicate != 0;
    g.state[std::size_t(i)] = AT_NAMED;
    g.named_id[std::size_t(i)] = static_cast<unsigned char>(id);
    if (b.arrived == b.expected) release_named(id);
    switch_to_scheduler(i);
    return g.barrier_result[std::size_t(i)];
}

// A barrier's call instance is its source line and the calls that led to it: not its code address,
// which the compiler may duplicate into the two sides of a divergent branch (it knows nothing of
// barriers: nvcc never does that). It may copy the calls that lead there too: threads whose chains of
// return addresses differ are at one barrier when the calls are at the same places of the source
// (barrier_converged asks).
extern "C" int emu_syncthreads_reduce(int predicate, int how, const char* file, int line) {
    Launch& g = *g_launch;
    const int i = g.current;
    if (g_check_values)
        check_defined(std::uint32_t(predicate), 4, "as the predicate of a barrier", __builtin_return_address(0));
    const void* innermost;
    g.barrier_calls[i].n = 0;
    const std::uint64_t outer = call_path(__builtin_frame_address(0), &innermost, 1, nullptr, &g.barrier_calls[i]);
    g.barrier_path[i] = outer ^ (reinterpret_cast<std::uintptr_t>(file) * 31 + std::uint64_t(line)) * 1099511628211ull;
    g.barrier_site[i] = {file, line};
    g.state[i] = AT_BARRIER;
    g.how[i] = static_cast<unsigned char>(how);
    ++g.at_barrier;
    g.barrier_sum += predicate != 0;
    g.barrier_and &= predicate != 0;
    g.barrier_or |= predicate != 0;
    switch_to_scheduler(i);
    return g.barrier_result[i];
}


extern "C" std::uint64_t emu_warp(int op, unsigned mask, std::uint64_t value, int arg, int width, int bytes) {
    Launch& g = *g_launch;
    const int i = g.current, lane = i % 32;
    if (g_check_values) {
        check_defined(mask, 4, "as the mask of a warp operation", __builtin_return_address(0));
        check_defined(std::uint32_t(arg), 4, "as the lane or offset of a shuffle", __builtin_return_address(0));
    }
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
    w.bytes[lane] = bytes;
    w.pc[lane] = __builtin_return_address(0);
    try_complete_warp(i / 32, mask);
    switch_to_scheduler(i);
    return w.result[lane];
}

namespace {
void warp_aligned(const char* what, const char* file, int line, const void* in, int bytes, void* out, bool rows,
                  std::uint64_t path, const void* pc) {
    Launch& g = *g_launch;
    const int i = g.current, lane = i % 32;
    Warp& w = g.warps[i / 32];
    if (bytes < 0 || bytes > kEmuAlignedBytes) fail_in_fiber(format("%s: %d bytes a lane", what, bytes));
    for (unsigned rest = w.waiting; rest; rest &= rest - 1) {
        const int other = __builtin_ctz(rest);
        if (w.op[other] == EMU_ALIGNED && w.path[other] != path)
            fail_in_fiber(format("synccheck: reached %s at %s:%d%s while lane %d waits in %s%s: a warp-wide .aligned "
                                 "instruction needs all 32 lanes at the same call", what, file, line, at(pc).c_str(),
                                 other, waits_in(w, other).c_str(), at(w.pc[other]).c_str()));
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
    w.rows[lane] = rows;
    w.path[lane] = path;
    w.pc[lane] = pc;
    try_complete_aligned(i / 32);
    switch_to_scheduler(i);
}
}  // namespace

// The wrappers of tensor_core.cuh call these from their emulation, a function of its own: the place to
// name is its caller's (the second return address).
extern "C" void emu_warp_aligned(const char* what, const char* file, int line, const void* in, int bytes,
                                 void* out) {
    const void *first, *caller = nullptr;
    const std::uint64_t path = call_path(__builtin_frame_address(0), &first, 0, &caller);
    warp_aligned(what, file, line, in, bytes, out, false, path, caller ? caller : first);
}

extern "C" void emu_warp_aligned_rows(const char* what, const char* file, int line, const void* row, int row_bytes,
                                      void* out) {
    const void *first, *caller = nullptr;
    const std::uint64_t path = call_path(__builtin_frame_address(0), &first, 0, &caller);
    warp_aligned(what, file, line, row, row_bytes, out, true, path, caller ? caller : first);
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
    if (g_launch->sanitize && in_shared(p, bytes) && !shared_variable(reinterpret_cast<std::uintptr_t>(p), bytes))
        fail_in_fiber(format("memcheck: %s at %s:%d: %zu bytes at %p are not in a __shared__ variable of the kernel "
                             "(nor in the dynamic shared memory the launch asked for)", what, file, line, bytes, p));
    if (!in_shared(p, bytes))
        fail_in_fiber(format("%s at %s:%d: %zu bytes at %p are not in the block's shared memory", what, file, line,
                             bytes, p));
    if (reinterpret_cast<std::uintptr_t>(p) % align)
        fail_in_fiber(format("%s at %s:%d: address %p is not a multiple of %zu bytes", what, file, line, p, align));
}

extern "C" void emu_cp_async(void* dst, const void* src, int bytes, int src_bytes, int cache_global,
                             const char* file, int line) {
    settle_store();   // before the copy fills its destination
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
    if (g_launch->sanitize > 1)   // dst is aligned to its size: whole words
        for (int k = 0; k < bytes; k += 4) {
            std::uint32_t& pending = g_shadow[(static_cast<unsigned char*>(dst) + k - g_launch->tls) / 4].pending;
            pending = g_launch->phase | (pending & kHopperMarked);
        }
    g_launch->async[g_launch->current].open.push_back(copy);
}

extern "C" void emu_cp_async_commit(void) {
    AsyncCopies& a = g_launch->async[g_launch->current];
    a.groups.push_back(std::move(a.open));
    a.open.clear();
}

extern "C" void emu_cp_async_wait(int pending_groups) {
    settle_store();   // before the copies land
    AsyncCopies& a = g_launch->async[g_launch->current];
    const std::size_t keep = std::size_t(pending_groups < 0 ? 0 : pending_groups);
    while (a.groups.size() > keep) {
        for (const AsyncCopy& c : a.groups.front()) {
            if (g_launch->sanitize > 1) {   // it lands: a write by the thread that issued it
                const auto dst = reinterpret_cast<std::uintptr_t>(c.dst);
                for (int k = 0; k < c.bytes; k += 4) g_shadow[(c.dst + k - g_launch->tls) / 4].pending &= kHopperMarked;
                shared_shadow(g_launch->current, dst, std::size_t(c.bytes), WRITE,
                              shared_or_fail(dst, std::size_t(c.bytes), WRITE, nullptr), __builtin_return_address(0));
            }
            std::memcpy(c.dst, c.data, std::size_t(c.src_bytes));
            std::memset(c.dst + c.src_bytes, 0, std::size_t(c.bytes - c.src_bytes));
        }
        a.groups.erase(a.groups.begin());
    }
}

extern "C" void emu_trap(const char* what) { fail_in_fiber(what); }

// ---- Hopper: what sm90.cuh's emulation calls (see Hopper above) ------------------------------------
extern "C" unsigned emu_shared_address(const void* p, const char* file, int line) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    if (!shared_variable(a, 1))
        fail_in_fiber(format("memcheck: smem_address at %s:%d: %p is not in a __shared__ variable of the kernel nor "
                             "in the dynamic shared memory the launch asked for (%zu bytes)", file, line, p,
                             g_launch->dynamic_bytes));
    return unsigned(to_window(a));
}

extern "C" void emu_mbarrier_init(void* bar, unsigned count, const char* file, int line) {
    settle_store();
    Launch& g = *g_launch;
    if (count < 1 || count > kMaxTxCount)
        fail_in_fiber(format("synccheck: mbarrier_init at %s:%d with count %u, outside 1..2^20-1", file, line, count));
    Hopper& h = hopper();
    const int index = find_barrier(bar, "mbarrier_init", file, line, true);
    MBarrier& b = h.barriers[std::size_t(index)];
    if (b.count && (b.pending != b.count || b.tx != 0 || !b.waiters.empty()))
        fail_in_fiber(format("synccheck: mbarrier_init at %s:%d of %s while its phase %u is in progress (%s%s)", file,
                             line, barrier_name(b).c_str(), b.phase, barrier_state(b).c_str(),
                             b.waiters.empty() ? "" : format(", %zu threads waiting", b.waiters.size()).c_str()));
    b.count = b.pending = count;
    b.tx = 0;
    b.phase = 0;
    b.init_thread = g.current;
    b.init_time = tick();
    b.init_block_phase = g.phase;
    b.init_file = file;
    b.init_line = line;
    if (h.clocks) {
        b.pending_clock.assign(std::size_t(h.slots), 0u);
        b.released.assign(std::size_t(h.slots), 0u);
        for (std::uintptr_t word = b.address; word < b.address + 8; word += 4) {
            g_hopper_words[word_index(word)].barrier = std::uint32_t(index) + 1;
            mark_word(word_index(word), kMbarrierWord);
        }
    }
}

extern "C" void emu_fence_barrier_init(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

extern "C" void emu_mbarrier_arrive(void* bar, unsigned tx_bytes, int expect_tx, const char* file, int line) {
    settle_store();
    const char* what = expect_tx ? "mbarrier_arrive_expect_tx" : "mbarrier_arrive";
    Hopper& h = hopper();
    MBarrier& b = h.barriers[std::size_t(find_barrier(bar, what, file, line, false))];
    check_init_visible(b, what, file, line);
    if (b.pending == 0)
        fail_in_fiber(format("synccheck: %s at %s:%d on %s, whose phase %u has had all its %u arrivals (it awaits %lld "
                             "transaction bytes): an arrival beyond the count", what, file, line,
                             barrier_name(b).c_str(), b.phase, b.count, b.tx));
    if (expect_tx) {
        if (tx_bytes > kMaxTxCount)
            fail_in_fiber(format("synccheck: %s at %s:%d expects %u bytes, more than 2^20-1", what, file, line, tx_bytes));
        b.tx += tx_bytes;
        check_tx_range(b, what, file, line);
    }
    if (h.clocks) {
        const int t = g_launch->current;
        join_clock(b.pending_clock.data(), clock_of(t));
        b.pending_clock[std::size_t(t)] = tick();
    }
    --b.pending;
    complete_phase(b);
}

extern "C" void emu_mbarrier_wait(void* bar, unsigned parity, const char* file, int line) {
    settle_store();
    Launch& g = *g_launch;
    Hopper& h = hopper();
    const int index = find_barrier(bar, "mbarrier_wait", file, line, false);
    MBarrier& b = h.barriers[std::size_t(index)];
    check_init_visible(b, "mbarrier_wait", file, line);
    const int t = g.current;
    parity &= 1;
    if ((b.phase & 1) != parity) {   // the phase of that parity has completed
        if (h.clocks) join_clock(clock_of(t), b.released.data());
        return;
    }
    HopperThread& me = h.thread[std::size_t(t)];
    me.wait_barrier = index;
    me.wait_parity = parity;
    me.wait_file = file;
    me.wait_line = line;
    b.waiters.push_back(t);
    g.state[std::size_t(t)] = AT_MBARRIER;
    switch_to_scheduler(t);   // complete_phase makes it runnable, its clock acquired
}

extern "C" void emu_tma_load(void* dst, const void* map, void* bar, int rank, const int* coords, const char* file,
                             int line) {
    settle_store();
    Launch& g = *g_launch;
    Hopper& h = hopper();
    const std::string what = format("tma_load_%dd", rank);
    EmuTensorMap m;
    std::memcpy(&m, map, sizeof m);
    if (m.magic != kEmuTensorMapMagic || m.rank < 1 || m.rank > 5 || !m.element_bytes)
        fail_in_fiber(format("%s at %s:%d: the TensorMap is not one the launch was given (an emu.TensorMap passed for "
                             "a `const __grid_constant__ TensorMap` parameter, handed to TMA as it is)", what.c_str(),
                             file, line));
    if (int(m.rank) != rank)
        fail_in_fiber(format("%s at %s:%d with a tensor map of rank %u", what.c_str(), file, line, m.rank));
    const int index = find_barrier(bar, what.c_str(), file, line, false);
    check_init_visible(h.barriers[std::size_t(index)], what.c_str(), file, line);
    // the box: where it goes, whether it fits
    std::size_t box_bytes = m.element_bytes;
    for (int i = 0; i < rank; ++i) box_bytes *= m.box[i];
    const std::size_t extent = m.swizzle ? (box_bytes + 127) / 128 * 128 : box_bytes;
    const auto d = reinterpret_cast<std::uintptr_t>(dst);
    shared_operand(d, extent, format("%s's destination (a box of %zu bytes)", what.c_str(), box_bytes), file, line);
    const std::size_t align = m.swizzle ? 1024 : 128;
    if (to_window(d) % align)
        fail_in_fiber(format("memcheck: %s at %s:%d: the destination %s (shared address 0x%lx) is not a multiple of "
                             "%zu bytes%s", what.c_str(), file, line, shared_place(d).c_str(),
                             static_cast<unsigned long>(to_window(d)), align,
                             m.swizzle ? ", which the 128-byte swizzle needs (its pattern repeats every 1024 bytes)" : ""));
    std::uint64_t reach = m.element_bytes;
    for (int i = 0; i < rank; ++i) reach += (m.dims[i] - 1) * m.strides[i];
    if (!in_argument(reinterpret_cast<const void*>(m.address), reach))
        fail_in_fiber(format("%s at %s:%d: the tensor map's tensor (%llu bytes at 0x%llx) is not memory of this "
                             "launch", what.c_str(), file, line, static_cast<unsigned long long>(reach),
                             static_cast<unsigned long long>(m.address)));
    // the box read, zeros outside the tensor (NaN: a map of nan_fill, CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA;
    // innermost first, the innermost fastest)
    h.box.assign(box_bytes, 0);
    if (m.nan_fill) {
        const std::uint32_t nan32 = 0x7fffffffu;
        const std::uint16_t nan16 = 0x7fffu;
        for (std::size_t e = 0; e < box_bytes; e += m.element_bytes)
            std::memcpy(h.box.data() + e, m.element_bytes == 4 ? static_cast<const void*>(&nan32) : &nan16,
                        m.element_bytes);
    }
    const std::size_t esize = m.element_bytes, inner = m.box[0], rows = box_bytes / (inner * esize);
    for (std::size_t row = 0; row < rows; ++row) {
        std::size_t rest = row;
        std::uint64_t offset = 0;
        bool inside = true;
        for (int i = 1; i < rank && inside; ++i) {
            const long long c = (long long)coords[i] + (long long)(rest % m.box[i]);
            rest /= m.box[i];
            inside = c >= 0 && c < (long long)m.dims[i];
            offset += std::uint64_t(c) * m.strides[i];
        }
        const long long c0 = coords[0], lo = std::max(c0, 0LL), hi = std::min(c0 + (long long)inner, (long long)m.dims[0]);
        if (inside && lo < hi)
            std::memcpy(h.box.data() + (row * inner + std::size_t(lo - c0)) * esize,
                        reinterpret_cast<const unsigned char*>(m.address + offset + std::uint64_t(lo) * esize),
                        std::size_t(hi - lo) * esize);
    }
    // written, chunk by chunk (swizzled: chunk j of each 128-byte row at j ^ (address >> 7 & 7))
    MBarrier& b = h.barriers[std::size_t(index)];
    if (h.clocks && b.agent < 0) {
        if (h.agents == kMaxTmaBarriers)
            fail_in_fiber(format("%s at %s:%d completes on a %dth mbarrier of the block: the emulator follows TMA loads "
                                 "on %d", what.c_str(), file, line, kMaxTmaBarriers + 1, kMaxTmaBarriers));
        b.agent = h.first_agent + h.agents++;
    }
    const TmaLoad load{file, line, index, g.current, b.phase, tick()};
    h.tmas.push_back(load);
    std::uint32_t verified[kMaxWarpgroups] = {};
    for (std::size_t o = 0; o < box_bytes; o += 16) {
        std::uintptr_t address = to_window(d + o);
        if (m.swizzle) address ^= (address >> 7 & 7) << 4;
        auto* p = reinterpret_cast<unsigned char*>(from_window(address));
        if (h.clocks)
            for (int k = 0; k < 16; k += 4)
                tma_write_word(reinterpret_cast<std::uintptr_t>(p) + std::uintptr_t(k), load,
                               std::uint32_t(h.tmas.size()), b.agent, verified);
        std::memcpy(p, h.box.data() + o, 16);
    }
    // complete_tx
    b.tx -= (long long)box_bytes;
    check_tx_range(b, what.c_str(), file, line);
    if (h.clocks) b.pending_clock[std::size_t(b.agent)] = tick();
    complete_phase(b);
}

extern "C" void emu_fence_proxy_async(void) {
    settle_store();
    hopper().thread[std::size_t(g_launch->current)].proxy_fence = tick();
}

extern "C" void emu_wgmma_fence(const char* file, int line) {
    settle_store();
    WarpgroupCall call{};
    call.op = WG_FENCE, call.file = file, call.line = line;
    warpgroup_instruction(call, __builtin_frame_address(0));
}

extern "C" void emu_wgmma_commit(const char* file, int line) {
    settle_store();
    WarpgroupCall call{};
    call.op = WG_COMMIT, call.file = file, call.line = line;
    warpgroup_instruction(call, __builtin_frame_address(0));
}

extern "C" void emu_wgmma_wait(int pending, const char* file, int line) {
    settle_store();
    WarpgroupCall call{};
    call.op = WG_WAIT, call.file = file, call.line = line, call.arg = pending;
    warpgroup_instruction(call, __builtin_frame_address(0));
}

extern "C" void emu_wgmma_bf16(float* d, int n, unsigned long long a, unsigned long long b, int accumulate,
                               int mn_major, const char* file, int line) {
    settle_store();
    if (n != 64 && n != 128)
        fail_in_fiber(format("wgmma_bf16<%d> at %s:%d: the emulator runs N = 64 and 128", n, file, line));
    WarpgroupCall call{};
    call.op = WG_MMA, call.file = file, call.line = line;
    call.d = d, call.n = n, call.a = a, call.b = b, call.accumulate = accumulate != 0, call.arg = mn_major != 0;
    warpgroup_instruction(call, __builtin_frame_address(0));
}

extern "C" void emu_wgmma_tf32(float* d, int n, unsigned long long a, unsigned long long b, int accumulate,
                               const char* file, int line) {
    settle_store();
    if (n != 64 && n != 128)
        fail_in_fiber(format("wgmma_tf32<%d> at %s:%d: the emulator runs N = 64 and 128", n, file, line));
    WarpgroupCall call{};
    call.op = WG_MMA, call.file = file, call.line = line, call.tf32 = true;
    call.d = d, call.n = n, call.a = a, call.b = b, call.accumulate = accumulate != 0;
    warpgroup_instruction(call, __builtin_frame_address(0));
}

extern "C" void emu_setmaxnreg(int registers, int increase, const char* file, int line) {
    settle_store();
    WarpgroupCall call{};
    call.op = WG_SETMAXNREG, call.file = file, call.line = line, call.arg = registers, call.accumulate = increase != 0;
    warpgroup_instruction(call, __builtin_frame_address(0));
}

// What -fsanitize=thread makes a module call (see the sanitizer): every load and store, by its size
// (aligned, or as the compiler knows it may not be), ranges, and function entries and exits; the
// atomics of cuda_emu.h are not instrumented (they check themselves through emu_check_access).
#define EMU_TSAN_HOOKS(PREFIX, N, ALIGNED)                                                                 \
    extern "C" void __tsan_##PREFIX##read##N(std::uintptr_t a) {                                          \
        instrumented(a, N, READ, ALIGNED, __builtin_return_address(0));                                  \
    }                                                                                                    \
    extern "C" void __tsan_##PREFIX##write##N(std::uintptr_t a) {                                         \
        instrumented(a, N, WRITE, ALIGNED, __builtin_return_address(0));                                 \
    }
EMU_TSAN_HOOKS(, 1, true)
EMU_TSAN_HOOKS(, 2, true)
EMU_TSAN_HOOKS(, 4, true)
EMU_TSAN_HOOKS(, 8, true)
EMU_TSAN_HOOKS(, 16, true)
EMU_TSAN_HOOKS(unaligned_, 2, false)
EMU_TSAN_HOOKS(unaligned_, 4, false)
EMU_TSAN_HOOKS(unaligned_, 8, false)
EMU_TSAN_HOOKS(unaligned_, 16, false)
#undef EMU_TSAN_HOOKS
// A copy of an 8- or 16-byte aggregate: a float2 or float4 (int2, ...), whose load a GPU makes in one
// instruction that needs the natural alignment (the instrumentation does not tell a vector type
// from another struct of that size).
extern "C" void __tsan_read_range(std::uintptr_t a, std::size_t n) {
    instrumented(a, n, READ, n == 8 || n == 16, __builtin_return_address(0));
}
extern "C" void __tsan_write_range(std::uintptr_t a, std::size_t n) {
    instrumented(a, n, WRITE, n == 8 || n == 16, __builtin_return_address(0));
}
// What -fsanitize-coverage=trace-cmp makes a module call before each comparison (and switch), with its
// operands: an undefined shuffle value may not be compared, and so not branched on. Operands of 1 or 2 bytes
// are never one.
namespace {
inline void compared(std::uint64_t x, std::uint64_t y, int bytes, const void* pc) {
    if (__builtin_expect(!g_check_values, 1)) return;
    settle_store();
    check_defined(x, bytes, "in a comparison", pc);
    check_defined(y, bytes, "in a comparison", pc);
}
}  // namespace

#define EMU_CMP_HOOKS(N, T)                                                                              \
    extern "C" void __sanitizer_cov_trace_cmp##N(T x, T y) { compared(x, y, N, __builtin_return_address(0)); } \
    extern "C" void __sanitizer_cov_trace_const_cmp##N(T x, T y) {                                         \
        compared(x, y, N, __builtin_return_address(0));                                                    \
    }
EMU_CMP_HOOKS(1, std::uint8_t)
EMU_CMP_HOOKS(2, std::uint16_t)
EMU_CMP_HOOKS(4, std::uint32_t)
EMU_CMP_HOOKS(8, std::uint64_t)
#undef EMU_CMP_HOOKS
extern "C" void __sanitizer_cov_trace_cmpf(float x, float y) {
    compared(emu::to_bits(x), emu::to_bits(y), 4, __builtin_return_address(0));
}
extern "C" void __sanitizer_cov_trace_cmpd(double x, double y) {
    compared(emu::to_bits(x), emu::to_bits(y), 8, __builtin_return_address(0));
}
// cases: their count, the value's width in bits, then the values of the cases
extern "C" void __sanitizer_cov_trace_switch(std::uint64_t value, const std::uint64_t* cases) {
    compared(value, value, int(cases[1] / 8), __builtin_return_address(0));
}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit(void) {}
extern "C" void __tsan_init(void) {}
extern "C" void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" void __tsan_atomic_signal_fence(int) {}

extern "C" void emu_threadfence() {
    Launch* g = g_launch;
    if (g && g->sanitize > 1 && g->current >= 0) on_threadfence();
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

extern "C" void emu_check_access(const void* p, std::size_t bytes, int how, const void* caller) {
    instrumented(reinterpret_cast<std::uintptr_t>(p), bytes, how, how == ATOMIC,
                 caller ? caller : __builtin_return_address(0));
}

extern "C" void emu_check_defined(std::uint64_t bits, int bytes, const char* what, const void* caller) {
    if (g_check_values) check_defined(bits, bytes, what, caller);
}

extern "C" void emu_assert_fail(const char* expr, const char* file, int line, const char* function) {
    fail_in_fiber(format("%s:%d: %s: device-side assertion `%s' failed", file, line, function, expr));
}

// ---- called from Python ------------------------------------------------------------------------
namespace {
struct SegmentSearch {
    std::uintptr_t base;
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>>* segments;
};

int find_segments(dl_phdr_info* info, std::size_t, void* data) {
    auto* want = static_cast<SegmentSearch*>(data);
    if (info->dlpi_addr != want->base) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i)
        if (info->dlpi_phdr[i].p_type == PT_LOAD)
            want->segments->emplace_back(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr,
                                         info->dlpi_addr + info->dlpi_phdr[i].p_vaddr + info->dlpi_phdr[i].p_memsz);
    return 1;
}

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
    auto* m = new Module{handle, nullptr, 0, {}};
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
    link_map* map = nullptr;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map) {
        SegmentSearch search{map->l_addr, &m->segments};
        dl_iterate_phdr(find_segments, &search);
    }
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

// Runs a grid. Returns 0, or 1 with a message in err (and, after a fault or an access the sanitizer
// refused, its address). `regions`: [start, end) of each argument buffer, `nregions` pairs.
// `sanitize`: 0, or check every access (a module compiled for it): 1 memcheck (and synccheck), 2 also
// racecheck and initcheck; `shared`: the kernel's __shared__
// variables, `nshared` pairs of (offset in the module's thread-local block, bytes), named by the
// newline-separated `shared_names`. `traffic`: null, or {requests, sectors, bytes} to which the launch's
// loads of its argument buffers are added (LoadTraffic; the sanitizer's hooks see them: `sanitize` 1 or 2).
extern "C" int emu_launch(Module* m, void (*entry)(void**), void** args, const unsigned* grid,
                          const unsigned* block, std::size_t dynamic_bytes, int descending,
                          const std::uint64_t* regions, int nregions, int sanitize,
                          const std::uint64_t* shared, int nshared, const char* shared_names,
                          std::uint64_t* traffic, std::uint64_t* fault_address, char* err, std::size_t errlen) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    Launch g{};
    g.entry = entry;
    g.args = args;
    g.module = m;
    g.sanitize = sanitize;
    LoadTraffic counter(traffic);
    g.traffic = traffic ? &counter : nullptr;
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
    g.barrier_path.assign(g.threads, 0);
    g.barrier_calls.assign(g.threads, CallChain{});
    g.barrier_site.assign(g.threads, {nullptr, 0});
    // the shared variables: what the sanitizer checks accesses against, and what sm90.cuh's shared addresses name
    {
        const auto tls = reinterpret_cast<std::uintptr_t>(g.tls);
        const char* name = shared_names;
        for (int v = 0; v < nshared; ++v) {
            const char* end = std::strchr(name, '\n');
            g.shared.push_back({tls + shared[2 * v], tls + shared[2 * v] + shared[2 * v + 1],
                                std::string(name, end ? std::size_t(end - name) : std::strlen(name))});
            name = end ? end + 1 : name + std::strlen(name);
        }
        const auto dynamic = reinterpret_cast<std::uintptr_t>(g.dynamic);
        g.shared.push_back({dynamic, dynamic + dynamic_bytes,
                            format("the dynamic shared memory (extern __shared__, %zu bytes asked for)", dynamic_bytes)});
        // shared address 0: the low bits of a shared address are the pointer's, as on a GPU (the swizzles)
        g.window = tls & ~std::uintptr_t(kEmuDynamicSharedAlign - 1);
        g.window_split = dynamic + kEmuDynamicSharedBytes + kEmuSharedTailBytes;
        const std::uintptr_t after = (dynamic - g.window + dynamic_bytes + kEmuDynamicSharedAlign - 1) /
                                     kEmuDynamicSharedAlign * kEmuDynamicSharedAlign;   // the bytes asked for, rounded up
        g.window_gap = (g.window_split - g.window - after) / kEmuDynamicSharedAlign * kEmuDynamicSharedAlign;
        if (dynamic % kEmuDynamicSharedAlign) {
            set_error(err, errlen, format("emulator: the dynamic shared memory is not %zu-byte aligned",
                                          kEmuDynamicSharedAlign));
            return 1;
        }
    }
    if (g.sanitize) {
        g.writers.assign(g.regions.size(), nullptr);
        if (g.sanitize > 1 && g_shadow.size() < g.tls_bytes / 4 + 1) g_shadow.resize(g.tls_bytes / 4 + 1);
    }
    g_report_address = 0;
    g_check_values = false;
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
    g_check_values = false;
    g_clocks = nullptr;
    clear_hopper_words();
    delete g.hopper;
    for (std::size_t r = 0; r < g.writers.size(); ++r)
        if (g.writers[r])
            munmap(g.writers[r], 2 * (g.regions[r].second - g.regions[r].first) * sizeof(std::uint32_t));
    *fault_address = g_report_address ? g_report_address : g_fault.address;
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
