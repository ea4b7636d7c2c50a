"""Prints TensorFlow's start-up chatter (as TF 2.21 does on a CPU machine), a real warning
and a line of its own, for the launcher's noise-filter tests."""

import sys

sys.stderr.write(
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1796297336.625808   25638 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n"
    "E0000 00:00:1796297343.575729   25638 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
    "W0000 00:00:1796297343.575729   25638 some_op.cc:12] a real warning\n"
)
sys.stderr.flush()
print("useful output", flush=True)
