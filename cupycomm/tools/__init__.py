"""The command-line tools: the self-check and field test that ``python -m cupycomm`` runs,
the flight recorder's reader (``python -m cupycomm.tools.flight DIR``) and the docs' tables
(``python -m cupycomm.tools.docs``).
"""
