"""Speculative decoding: proposers that guess a request's next tokens on the host (n-gram
prompt lookup), and which requests may speculate. Verification (rejection sampling) runs in
the worker's sampler (``sample/rejection.py``)."""
