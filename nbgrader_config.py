"""nbgrader configuration of the gptlab course (nbgrader 0.9, SQLite gradebook).

Instructors' notebooks, with solutions and autograded tests, live in ``solutions/<assignment>/``;
``nbgrader generate_assignment <assignment>`` writes the learners' copies to
``exercises/<assignment>/`` (committed, and checked by ``tests/test_grading.py`` to be exactly
what this command produces). Graded submissions go to ``submitted/<student>/<assignment>/`` and
``nbgrader autograde <assignment>`` scores them into ``gradebook.db``.
"""

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

c.CourseDirectory.course_id = "gptlab"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
c.CourseDirectory.db_url = "sqlite:///gradebook.db"

# Test cells import torch and, in the training exercises, run a few optimisation steps on CPU:
# nbgrader's default of 30 s per cell is too short for those.
c.Execute.timeout = 600
# The checks print a diagnosis of the most likely mistake; keep it in full in the feedback.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
