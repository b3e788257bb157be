// CUDA host-function bridge: a captured CUDA graph hands one MoE layer's CPU share to a CPU worker and
// waits for it, with no Python on CUDA's callback thread.
//
// A CpuTask binds, once, the static pinned buffers one layer step reads and writes (hidden states, CPU expert
// ids, routing weights, fp32 output) and the layer's host expert weights. Its two host functions are captured
// into the graph on the compute stream:
//   submit  - runs after the device-to-host copies of that step's inputs: queues the task on the worker, returns
//   sync    - blocks CUDA's callback thread until the worker finished the task (the host-to-device copy of the
//             output follows it in the stream)
// The GPU computes its own share between the two. The payload of both host functions is the CpuTask itself, so
// it must outlive every graph it was captured into (Python keeps it with the graph). `cuLaunchHostFunc` comes
// from the driver library through dlopen: building needs no CUDA toolkit, and a machine without a driver gets
// a clear error when a launch is attempted, never a silently skipped task.

#include "moe_cpu.h"

#include <dlfcn.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace {

using CUresult = int;
using CUstream = void*;
using CUhostFn = void (*)(void*);
using LaunchHostFunc = CUresult (*)(CUstream, CUhostFn, void*);
using GetErrorString = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchHostFunc launch_host_func = nullptr;
  GetErrorString get_error_string = nullptr;
  std::string error;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      r.error = std::string("cannot load the CUDA driver library libcuda.so.1: ") + (why ? why : "unknown error");
      return r;
    }
    r.launch_host_func = reinterpret_cast<LaunchHostFunc>(dlsym(lib, "cuLaunchHostFunc"));
    r.get_error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    if (r.launch_host_func == nullptr) r.error = "libcuda.so.1 has no cuLaunchHostFunc (driver older than CUDA 10)";
    return r;
  }();
  return d;
}

class CpuTask;

// One thread runs the CPU shares in submission order; each task parallelises inside with torch's threads.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) { thread_.detach(); }

  void post(CpuTask* task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(task);
    }
    cv_.notify_one();
  }

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<CpuTask*> queue_;
  std::thread thread_;
};

// Never destroyed: the thread must not be joined while the interpreter tears down.
Worker& worker() {
  static Worker* w = new Worker();
  return *w;
}

std::mutex error_mutex;
std::string first_error;  // the first exception a task raised, until taken by Python

class CpuTask {
 public:
  CpuTask(at::Tensor hidden, at::Tensor ids, at::Tensor weights, at::Tensor gate_up,
          c10::optional<at::Tensor> gate_up_scale, at::Tensor down, c10::optional<at::Tensor> down_scale,
          at::Tensor out, int64_t threads, int64_t gemm_tokens, int64_t gemm_kernel)
      : hidden_(std::move(hidden)),
        ids_(std::move(ids)),
        weights_(std::move(weights)),
        gate_up_(std::move(gate_up)),
        gate_up_scale_(std::move(gate_up_scale)),
        down_(std::move(down)),
        down_scale_(std::move(down_scale)),
        out_(std::move(out)),
        threads_(threads),
        isa_(best_isa()),
        gemm_tokens_(gemm_tokens),
        gemm_kernel_(gemm_kernel) {
    TORCH_CHECK(threads_ > 0, "threads must be positive");
    for (const at::Tensor* t : {&hidden_, &ids_, &weights_, &out_})
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "task buffers must be contiguous CPU tensors");
    TORCH_CHECK(ids_.scalar_type() == at::kLong && weights_.scalar_type() == at::kFloat &&
                    out_.scalar_type() == at::kFloat && out_.sizes() == hidden_.sizes(),
                "expected int64 ids, fp32 weights and an fp32 output shaped like hidden");
    // Check shapes and formats here, on the caller's thread, by a run with no pairs: the worker must not throw
    // (an exception built on a thread Python does not know can crash the interpreter).
    at::Tensor none = at::full_like(ids_, -1);
    at::Tensor scratch = at::zeros_like(out_);
    moe_experts(hidden_, none, weights_, gate_up_, gate_up_scale_, down_, down_scale_, isa_, gemm_tokens_, gemm_kernel_,
                scratch);
  }

  ~CpuTask() { wait_done(); }

  // Host function body: queue the work and return at once.
  void submit() {
    submits_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++submitted_;
    }
    worker().post(this);
  }

  // Host function body: block until every submitted run has finished.
  void wait() {
    syncs_.fetch_add(1);
    wait_done();
  }

  void run() {
    const std::string bad = check_ids();
    if (!bad.empty()) {
      record_error(bad);
    } else {
      try {
        if (at::get_num_threads() != threads_) at::set_num_threads(threads_);
        out_.zero_();
        moe_experts(hidden_, ids_, weights_, gate_up_, gate_up_scale_, down_, down_scale_, isa_, gemm_tokens_,
                    gemm_kernel_, out_);
      } catch (const std::exception& err) {
        record_error(err.what());
      }
    }
    runs_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++completed_;
    }
    cv_.notify_all();
  }

  void launch_submit(int64_t stream) { launch(stream, &CpuTask::submit_fn); }
  void launch_sync(int64_t stream) { launch(stream, &CpuTask::sync_fn); }

  int64_t submits() const { return submits_.load(); }
  int64_t syncs() const { return syncs_.load(); }
  int64_t runs() const { return runs_.load(); }

 private:
  // The ids are written by the device at replay time: validate them without throwing.
  std::string check_ids() const {
    const int64_t* id = ids_.data_ptr<int64_t>();
    const int64_t experts = gate_up_.size(0);
    for (int64_t i = 0; i < ids_.numel(); ++i)
      if (id[i] < -1 || id[i] >= experts)
        return "expert id " + std::to_string(id[i]) + " outside [-1, " + std::to_string(experts) + ")";
    return {};
  }

  static void record_error(const std::string& what) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (first_error.empty()) first_error = what;
  }

  void wait_done() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return completed_ >= submitted_; });
  }

  static void submit_fn(void* self) { static_cast<CpuTask*>(self)->submit(); }
  static void sync_fn(void* self) { static_cast<CpuTask*>(self)->wait(); }

  void launch(int64_t stream, CUhostFn fn) {
    const Driver& d = driver();
    TORCH_CHECK(d.launch_host_func != nullptr, d.error);
    const CUresult rc = d.launch_host_func(reinterpret_cast<CUstream>(stream), fn, this);
    if (rc != 0) {
      const char* msg = nullptr;
      if (d.get_error_string != nullptr) d.get_error_string(rc, &msg);
      TORCH_CHECK(false, "cuLaunchHostFunc failed with CUDA error ", rc, ": ", msg ? msg : "unknown");
    }
  }

  at::Tensor hidden_, ids_, weights_, gate_up_;
  c10::optional<at::Tensor> gate_up_scale_;
  at::Tensor down_;
  c10::optional<at::Tensor> down_scale_;
  at::Tensor out_;
  const int64_t threads_, isa_, gemm_tokens_;
  const int64_t gemm_kernel_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t submitted_ = 0, completed_ = 0;
  std::atomic<int64_t> submits_{0}, syncs_{0}, runs_{0};
};

void Worker::loop() {
  for (;;) {
    CpuTask* task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return !queue_.empty(); });
      task = queue_.front();
      queue_.pop_front();
    }
    task->run();
  }
}

std::string take_error() {
  std::lock_guard<std::mutex> lock(error_mutex);
  std::string err;
  err.swap(first_error);
  return err;
}

}  // namespace

void bind_host_bridge(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<CpuTask, std::shared_ptr<CpuTask>>(m, "CpuTask", "One layer's CPU expert share, run by the worker thread")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, at::Tensor,
                    c10::optional<at::Tensor>, at::Tensor, int64_t, int64_t, int64_t>(),
           py::arg("hidden"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"), py::arg("gate_up_scale"),
           py::arg("down"), py::arg("down_scale"), py::arg("out"), py::arg("threads"),
           py::arg("gemm_tokens") = int64_t(1) << 62,
           py::arg("gemm_kernel") = int64_t(0))  // default: micro-kernels only
      .def("submit", &CpuTask::submit, "Queue the task now (what the submit host function does)")
      .def("wait", &CpuTask::wait, "Block until it finished (what the sync host function does)",
           py::call_guard<py::gil_scoped_release>())
      .def("launch_submit", &CpuTask::launch_submit, "Enqueue the submit host function on a CUDA stream")
      .def("launch_sync", &CpuTask::launch_sync, "Enqueue the sync host function on a CUDA stream")
      .def_property_readonly("submits", &CpuTask::submits)
      .def_property_readonly("syncs", &CpuTask::syncs)
      .def_property_readonly("runs", &CpuTask::runs);
  m.def("take_task_error", &take_error, "The first error a CPU task raised since the last call ('' if none)");
}
