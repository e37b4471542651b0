"""Parsers for what dying processes print, on real captured text (tests/fixtures/crash/streams)."""

from __future__ import annotations

from fpdoctor.crash import parse
from fpdoctor.meanings import ERRORS, SIGNALS, explain_text, signal_meaning
from tests.conftest import FIXTURES

STREAMS = FIXTURES / "crash" / "streams"


def text(name: str) -> str:
    return (STREAMS / name).read_text(encoding="utf-8")


def test_faulthandler_dump_all_threads():
    (dump,) = parse.faulthandler_dumps(text("faulthandler_py311_sigfpe.txt"))
    assert (dump.signal, dump.header) == ("SIGFPE", "Floating point exception")
    assert [t.current for t in dump.threads] == [False, True]
    current = dump.current()
    assert current is not None and current.thread == "0x00007fafe4be9b80"
    assert [f.text() for f in current.frames] == [
        "/home/user/train.py:8 in forward",
        "/home/user/train.py:10 in step",
        "/home/user/train.py:11 in <module>",
    ]
    assert dump.threads[0].frames[0].function == "loader"


def test_faulthandler_dumps_in_a_shared_stream():
    """Two dumps on one stream (prefixed by torch.distributed's [rankN]), a dump on request
    (SIGTERM: no header) and unrelated output between them."""
    fatal = text("faulthandler_py311_sigfpe.txt")
    stream = "\n".join(
        [
            "step 1 loss 0.5",
            *(f"[rank1]: {line}" for line in fatal.splitlines()),
            "",
            "Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)",
            "Thread 0x00007f0000000001 (most recent call first):",
            '  File "/x/loader.py", line 3 in run',
            "",
            "Current thread 0x00007f0000000002 [MainThread] (most recent call first):",
            '  File "/v/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
            '  File "/x/train.py", line 40 in main',
            "  ...",
        ]
    )
    first, second = parse.faulthandler_dumps(stream)
    assert first.signal == "SIGFPE" and first.origin == "1" and len(first.threads) == 2
    assert second.signal is None and second.header is None
    current = second.current()
    assert current is not None and current.thread == "0x00007f0000000002 [MainThread]" and current.truncated
    assert [f.function for f in current.frames] == ["all_reduce", "main"]


def test_python_314_c_stack_is_read_as_native_frames():
    dump_text = "\n".join(
        [
            "Fatal Python error: Segmentation fault",
            "",
            "Current thread 0x00007f5e1c3b2740 (most recent call first):",
            '  File "/x/ext.py", line 9 in call',
            "",
            "Current thread's C stack trace (most recent call first):",
            '  Binary file "/lib/x86_64-linux-gnu/libc.so.6", at +0x45330 [0x7f5e1c445330]',
            '  Binary file "/x/ext.so", at bad_call+0x12 [0x7f5e1b000012]',
            "",
        ]
    )
    (dump,) = parse.faulthandler_dumps(dump_text)
    assert dump.signal == "SIGSEGV" and dump.current().frames[0].function == "call"  # type: ignore[union-attr]
    assert len(dump.native) == 2 and "bad_call+0x12" in dump.native[1]


def test_pytorch_fatal_signal_handler_frames():
    (trace,) = parse.native_traces(text("c10_fatal_signal_handler_sigfpe.txt"))
    assert (trace.kind, trace.signal, trace.pid) == ("c10", "SIGFPE", 32590)
    assert len(trace.frames) == 8 and trace.frames[0].startswith("c10::FatalSignalHandler::stacktraceSignalHandler")
    assert trace.frames[-1].startswith("_start")


def test_ucx_backtrace_of_the_h20_crash():
    (trace,) = parse.native_traces(text("ucx_sigfpe_vllm2798.txt"))
    assert (trace.kind, trace.signal, trace.pid) == ("ucx", "SIGFPE", 279)
    assert "integer divide by zero" in trace.title
    assert trace.frames[-1] == "cublasLtMatmulAlgoCheck()  ???:0"
    assert explain_text("\n".join(trace.frames)) is None  # frames alone are not an error text


def test_cpp_terminate_with_its_what_text():
    (trace,) = parse.native_traces(text("cpp_terminate_illegal_address.txt"))
    assert (trace.kind, trace.signal) == ("terminate", "SIGABRT")
    assert "what(): CUDA error: an illegal memory access was encountered" in trace.title
    assert len(trace.frames) == 4 and trace.frames[2].startswith("c10::cuda::c10_cuda_check_implementation")
    error = explain_text(trace.title)
    assert error is not None and error.key == "illegal-address"


def test_glibc_abort_messages():
    (trace,) = parse.native_traces("free(): invalid pointer\nAborted (core dumped)\n")
    assert (trace.kind, trace.signal, trace.title) == ("glibc", "SIGABRT", "free(): invalid pointer")


def test_torchrun_summary_root_cause_first():
    failures = parse.launcher_failures(text("torchrun_rank1_sigfpe.txt"))
    assert [(f.rank, f.local_rank, f.exitcode, f.pid, f.root_cause) for f in failures] == [
        (1, 1, -8, 25721, True),
        (0, 0, -15, 25720, False),
    ]
    root = failures[0]
    assert root.signal == "SIGFPE" and root.host == "localhost" and root.error_file is None
    assert root.traceback == "Signal 8 (SIGFPE) received by PID 25721"


def test_torchrun_log_line_without_summary():
    line = (
        "E1123 09:04:41.081000 25693 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        "(exitcode: -9) local_rank: 3 (pid: 4242) of binary: /usr/bin/python3"
    )
    (failure,) = parse.launcher_failures(line)
    assert (failure.pid, failure.exitcode, failure.local_rank, failure.signal) == (4242, -9, 3, "SIGKILL")


def test_every_fatal_signal_is_explained():
    for name in ("SIGFPE", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGKILL", "SIGTERM"):
        assert len(SIGNALS[name].text) > 40, name
    assert "out-of-memory killer" in signal_meaning("SIGKILL").text
    assert signal_meaning("SIGRTMIN").text  # unknown signals still get a sentence


def test_error_texts_are_explained_root_cause_first():
    cases = {
        "RuntimeError: CUDA error: an illegal memory access was encountered": "illegal-address",
        "RuntimeError: CUDA error: device-side assert triggered": "device-assert",
        "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`": (
            "cublas-failed"
        ),
        "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul`": "cublas-not-supported",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": "out-of-memory",
        "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR": "cudnn",
        "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)": "nccl-timeout",
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error": "nccl",
        "RuntimeError: CUDA error: no kernel image is available for execution on the device": "no-kernel-image",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered": "ecc",
        "fpdoctor.numerics.trace.tracer.NonFiniteError: aten.div.Tensor produced NaN": "nonfinite",
        "ValueError: Loss is NaN, stopping training": "nonfinite",
        "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and Half": "dtype-mismatch",
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.": "dataloader-worker",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer": "peer-gone",
    }
    for message, key in cases.items():
        error = explain_text(message)
        assert error is not None and error.key == key, (message, error and error.key)
        assert error.meaning.text
    assert explain_text("ValueError: the batch had no rows") is None
    assert len({e.key for e in ERRORS}) == len(ERRORS)
    assert {e.finding for e in ERRORS} == {"cuda-error", "uncaught-exception"}


def test_torchrun_log_lines_anywhere_in_the_stream():
    """Without the summary (torchrun stopped, or restarting its workers) every 'failed' line
    counts, not only one that ends the stream."""
    stream = "\n".join(
        [
            "E1123 09:04:41.081000 25693 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
            "(exitcode: -8) local_rank: 1 (pid: 4243) of binary: /usr/bin/python3",
            "E1123 09:04:41.090000 25693 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
            "(exitcode: -15) local_rank: 0 (pid: 4242) of binary: /usr/bin/python3",
            "Traceback (most recent call last):",
            '  File "/usr/bin/torchrun", line 8, in <module>',
        ]
    )
    assert [(f.pid, f.exitcode, f.local_rank) for f in parse.launcher_failures(stream)] == [
        (4243, -8, 1),
        (4242, -15, 0),
    ]
