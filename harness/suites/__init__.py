"""Other test suites run under fusion.

    pytest_plugin   pytest plugin (public name `-p harness.pytest_fusion`): fuse every model a
                    test suite builds, compare outcomes
    hf_tests/       Transformers' common model tests on corpus architectures, fused vs not

May import: harness.runner and the layers below it.
"""
