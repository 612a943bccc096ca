"""What the tests share: launching processes (launch.py), the cases the launched workers and
the tests both run (program_cases, reshard_cases, jax_suite, checkpoint_matrix), hypothesis
strategies and grammars, and fakes of a torch world for single-process tests. No test module
imports another test module; both import from here."""
