"""The scripts' shared machinery, a concern per file (README's table); what it asks of a script: docs/modifying.md."""
