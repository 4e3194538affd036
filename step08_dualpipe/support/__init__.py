"""What keeps a run measured and safe, kept out of the idea's way. A first reading can skip this folder.

faults.py (a dead or silent peer, in one line), budget.py (the memory a run needs, checked before it starts),
distributed.py (start-up and shutdown), timeline.py (what each rank did, and when), report.py (what a run
prints), plots.py (the notebook's runs and drawings), dualpipe_plots.py (the drawings of this step's side
roads), memory.py (the activation meter, from step 02), checkpoint.py (save and resume, from step 03),
notebook.py (the notebooks' source, tables and parsed flags),
outputs.py (the one rule of every file a run writes) and progress.py (where a run is, and Ctrl-C's line).
"""
