"""What the tests share: tiny checkpoints and GGUF files, an in-process engine harness, scripted
and fake services, a chi-square test, an OTLP receiver, throwaway PKI, the CPU's capabilities."""
