// What the idle core could gain in a decode step's serial gaps: two threads stream a 1 GiB buffer as a sequence of
// "ops" of CHUNK_MB each (each thread sums half of an op, as the matvecs' two threads split their rows), and between
// two ops thread 0 works alone for GAP_US (the compiled step's wrapper, small kernels, an op's serial part), while
// thread 1 waits, as libgomp's worker spins there. With PRE_MB > 0, thread 1 instead reads the first PRE_MB of the
// next op during the gap, so that op finds them in cache. Prints ms a pass (5 passes after a warm-up): the gain is the
// pass with PRE_MB against the pass without. Standalone (no torch); x86-64 with AVX-512F.
//
//   g++ -O2 -march=native -std=c++17 -pthread benchmarks/serial_gap_prefetch.cpp -o /tmp/gap
//   for pre in 0 1 2 3 4; do /tmp/gap 4 40 $pre; done; for pre in 0 0.5 1; do /tmp/gap 2 20 $pre; done
#include <immintrin.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sum of n floats (n a multiple of 64): a streaming read at one core's rate.
float sum_range(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s CHUNK_MB GAP_US PRE_MB\n", argv[0]);
    return 2;
  }
  const size_t total = size_t(1) << 30;
  const size_t chunk = size_t(std::atof(argv[1]) * 1e6) / 512 * 512;  // even halves of whole 64-float steps
  const double gap_us = std::atof(argv[2]);
  const size_t pre = size_t(std::atof(argv[3]) * 1e6) / 256 * 256;
  if (chunk == 0 || chunk > total || pre > chunk) {
    std::fprintf(stderr, "CHUNK_MB must be in (0, 1073], PRE_MB at most CHUNK_MB\n");
    return 2;
  }
  float* buf = static_cast<float*>(std::aligned_alloc(size_t(2) << 20, total));
  madvise(buf, total, MADV_HUGEPAGE);
  std::memset(buf, 1, total);
  const size_t nchunks = total / chunk;
  // Thread 1's orders, numbered: 2g + 1 reads the second half of op g, 2g + 2 pre-reads op g + 1's start; -1 stops.
  std::atomic<long> order{0}, done{0};
  std::atomic<float> sink{0};
  std::thread worker([&] {
    for (long seen = 0;;) {
      long p;
      while ((p = order.load(std::memory_order_acquire)) == seen) _mm_pause();
      if (p < 0) break;
      seen = p;
      const float* op = buf + (size_t(p / 2) % nchunks) * (chunk / 4);
      float s = 0;
      if (p % 2 == 1)
        s = sum_range(op + chunk / 8, chunk / 8);
      else if (pre)
        s = sum_range(op, pre / 4);
      sink.store(sink.load() + s);
      done.store(p, std::memory_order_release);
    }
  });
  long g = 0;
  for (int pass = 0; pass < 6; ++pass) {
    const double t0 = now_us();
    for (size_t i = 0; i < nchunks; ++i, ++g) {
      const long ahead = 2 * g + 2, half = 2 * (g + 1) + 1;
      order.store(ahead, std::memory_order_release);  // the gap: thread 0 alone
      for (const double g0 = now_us(); now_us() - g0 < gap_us;) _mm_pause();
      while (done.load(std::memory_order_acquire) != ahead) _mm_pause();
      order.store(half, std::memory_order_release);  // the op: both halves
      const float s = sum_range(buf + (size_t(g + 1) % nchunks) * (chunk / 4), chunk / 8);
      sink.store(sink.load() + s);
      while (done.load(std::memory_order_acquire) != half) _mm_pause();
    }
    const double t = now_us() - t0;
    if (pass > 0)
      std::printf("ops of %.2f MB, gaps of %.0f us, %.2f MB read ahead: %.2f ms a pass (%.2f ms of it gaps)\n",
                  chunk / 1e6, gap_us, pre / 1e6, t / 1e3, nchunks * gap_us / 1e3);
  }
  order.store(-1, std::memory_order_release);
  worker.join();
  std::free(buf);
  volatile float keep = sink.load();  // the sums are used
  (void)keep;
  return 0;
}
