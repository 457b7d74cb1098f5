"""Bundled jobs: ``smoke`` (launcher self-test), ``digits`` (data-parallel MLP), ``allreduce``,
``probe`` (the cost model's profile), ``lbann-mlp`` (LBANN's 3x4096 MLP on the digits) and
``bytes-lm`` (byte-level transformer on the Python standard library's source). The benchmarks'
own jobs live with them in ``benchmarks/``.

A job is any ``module:function`` taking a :class:`jaxcomm_launcher.context.JobContext`. The
``args`` each bundled job takes are declared in :mod:`jaxcomm_launcher.jobs.args`, where the
recipe validator checks them before any rank starts.
"""
