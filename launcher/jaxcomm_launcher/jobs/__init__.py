"""Bundled jobs: ``smoke`` (launcher self-test), ``digits`` (data-parallel MLP), ``allreduce``.

A job is any ``module:function`` taking a :class:`jaxcomm_launcher.context.JobContext`.
"""
