"""The tools on top of the services: the `specstream` command (cli/), the launcher and supervisor
of a stack, benchmarks (bench/), draft training (distill/), reliability runs (reliability/), and
the repository's own scripts (gen_protos, gpu_check, kernel_resources). Nothing below imports them."""
