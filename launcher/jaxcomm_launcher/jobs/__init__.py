"""Bundled jobs: ``smoke`` (launcher self-test), ``digits`` (data-parallel MLP), ``allreduce``,
``overlap`` (communication hidden behind the backward pass).

A job is any ``module:function`` taking a :class:`jaxcomm_launcher.context.JobContext`.
"""
