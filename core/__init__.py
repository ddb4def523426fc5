"""The ground floor: specs, the LR schedule, the cost model, the run directory and file helpers.

Imports nothing from engines, ladder or analysis; everything else may import it.
"""
