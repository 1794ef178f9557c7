"""eagle3lab: a Jupyter research workbook for EAGLE-3 speculative decoding on vLLM.

Importing the package stays cheap (no torch, no vLLM): vLLM imports the plugin entry point
(``eagle3lab.plugin``) in every process it starts. DESIGN.md's module map shows the layers.
"""

__version__ = "0.1.0"
