"""Bundled jobs: ``smoke`` (launcher self-test), ``digits`` (data-parallel MLP), ``allreduce``,
``lbann-mlp`` (LBANN's 3x4096 MLP on the digits), ``bytes-lm`` (byte-level transformer on
the Python standard library's source) and ``overlap`` (communication hidden behind the backward
pass).

A job is any ``module:function`` taking a :class:`jaxcomm_launcher.context.JobContext`. The
``args`` each bundled job takes are declared in :mod:`jaxcomm_launcher.jobs.args`, where the
recipe validator checks them before any rank starts.
"""
