"""``python -m jaxcomm_launcher ...`` runs the ``jaxcomm`` command (also when the venv's
``bin``, where the ``jaxcomm`` script lives, is not on ``PATH``)."""

from jaxcomm_launcher import main

main()
