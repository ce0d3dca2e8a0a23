"""Transformers' own common model tests, run on corpus architectures (and under fusion).

    python -m pytest tests/hf_suite/hf_mixins.py                 # unfused
    python -m harness.suites.hf_tests --arch llama --arch mixtral        # unfused vs fused, compared

`sdist` fetches and caches the common mixins from the Transformers source distribution,
`tester` drives them with the corpus's tiny configs, `exceptions` lists the tests fusion may
break on purpose (each with its reason), `compare` runs both and names what fusion broke.
"""
