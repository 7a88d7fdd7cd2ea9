"""Server-side capture of prefill hidden states into an hsdata store (SGLang: ``server_hook.sglang:make_hook``)."""
