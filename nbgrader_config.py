"""nbgrader configuration of the gptlab course (nbgrader 0.9, SQLite gradebook).

Instructors' notebooks, with solutions and autograded tests, live in ``solutions/<assignment>/``;
``python -m gptlab course release`` (nbgrader's ``generate_assignment``) writes the learners'
copies to ``exercises/<assignment>/`` (committed, and checked by the tests to be exactly what
nbgrader produces). Submissions are collected into ``submitted/<student>/<assignment>/`` and
``python -m gptlab course autograde`` (or ``nbgrader autograde``) scores them into
``gradebook.db``, beside this file. See ``book/instructors.md``.
"""

import os

from nbgrader.preprocessors import (
    AssignLatePenalties,
    CheckCellMetadata,
    IgnorePattern,
    LimitOutput,
    SaveAutoGrades,
)

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)
HERE = os.path.dirname(os.path.abspath(__file__))

c.CourseDirectory.course_id = "gptlab"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
# The gradebook sits beside this file, whatever the working directory.
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(HERE, "gradebook.db")

# Time limits. Every cell may run 30 s (a test cell must give its verdict in under 5 s on 2 CPU
# cores; the rest is room for a busy machine), so a learner's endless loop costs 30 s and that
# task only. A cell that needs longer (the graded training of a training assignment) declares it
# in its metadata: {"gptlab": {"timeout": 600}} (cells with an nbgrader grade_id only, at most
# GptlabExecute.max_timeout). After a timeout the kernel is interrupted and the next cells run;
# a kernel that dies is restarted and the notebook goes on (gptlab/course/execute.py).
c.Execute.timeout = 30
c.Execute.interrupt_on_timeout = True
c.GptlabExecute.max_timeout = 1800
c.GptlabExecute.max_kernel_restarts = 3
# nbgrader's autograde steps, with gptlab's runner in place of nbgrader's Execute (named as a
# string, so that loading this file does not import gptlab and torch).
c.Autograde.autograde_preprocessors = [
    "gptlab.course.execute.GptlabExecute",
    IgnorePattern,
    LimitOutput,
    SaveAutoGrades,
    AssignLatePenalties,
    CheckCellMetadata,
]
# A deleted test cell is put back from the gradebook and run (with a comment saying so).
c.OverwriteCells.add_missing_cells = True

# The checks print a diagnosis of the most likely mistake; keep it in full in the feedback.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
