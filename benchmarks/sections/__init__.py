"""The sections of benchmarks/throughput.py, one module each: its rows (measured), its table and its
summary line (`SECTION`, `table(meta, rows)`, `headline(row)`, and `COMPARED` where --compare reads it).

  bandwidth.py     copy       the device's copy bandwidth
  weights.py       weights    the weight-reading part of an SDAR block step
  sdar.py          sdar       SDAR generate: tokens/s, decode per forward, bandwidth, methods
  llada.py         llada      LLaDA generate: tokens/s with the Fast-dLLM caches and methods
  long_cache.py    mage128k   one output block against a long cache, dense and MAGE
  compile_time.py  compile    first call - warm call
  plan.py          the sizes of a run; measure.py the shared estimates and rows; models.py the one random
                   model alive; report.py the Markdown and the summary; tables.py the table writer

Imports inside are relative: throughput.py loads this folder as `benchmarks.sections`, or as `sections`
when it runs as a file beside an old package (--baseline).
"""

from . import bandwidth, compile_time, llada, long_cache, measure, models, plan, report, sdar, tables, weights

__all__ = ["bandwidth", "compile_time", "llada", "long_cache", "measure", "models", "plan", "report", "sdar", "tables",
           "weights"]
