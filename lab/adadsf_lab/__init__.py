"""The adadsf-modifier lab: the results study (:mod:`.study`), the main job's report
(:mod:`.report`) and the commands that run them (:mod:`.commands`).

It imports the plug-in (``adadsf_modifier``) and is never imported by it; the plug-in's
CLI finds these commands through the ``adadsf.commands`` entry point.
"""
