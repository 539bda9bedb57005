"""CPU sandbox: real SGLang prefill/decode on 127.0.0.1, for tests and by hand."""
