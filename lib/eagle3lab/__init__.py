"""eagle3lab: a Jupyter research workbook for EAGLE-3 speculative decoding on vLLM.

Importing the package stays cheap (no torch, no vLLM): the vLLM plugin entry point imports
``eagle3lab.patch`` in every vLLM process.
"""

__version__ = "0.1.0"
