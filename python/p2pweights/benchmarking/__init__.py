"""Benchmarks behind `p2pweights bench`: each module has add_arguments(parser) and run(args)."""
