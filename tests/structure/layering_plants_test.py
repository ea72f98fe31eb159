#!/usr/bin/env python3
"""The layering check fails on a planted back-arrow: each test copies the layered folders and
server/CMakeLists.txt to a temporary tree, plants one fault and asserts the check's exact
messages (layering_test.py passing on the real tree says nothing unless it can fail).

    python3 tests/structure/layering_plants_test.py
"""

import importlib.util
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
_spec = importlib.util.spec_from_file_location("layering", os.path.join(HERE, "layering_test.py"))
layering = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layering)

BUILD = "server/CMakeLists.txt"


class Plants(unittest.TestCase):
    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="layering_")
        self.addCleanup(shutil.rmtree, self.root)
        ignore = shutil.ignore_patterns("python")  # client/python: no layer, not read
        for top in ("common", "server", "client"):
            shutil.copytree(os.path.join(ROOT, top), os.path.join(self.root, top), ignore=ignore)

    def edit(self, path, old, new):
        """Replaces the one occurrence of old in path; returns the line it starts on."""
        full = os.path.join(self.root, path)
        with open(full, encoding="utf-8") as f:
            text = f.read()
        self.assertEqual(text.count(old), 1, f"{old!r} in {path}")
        with open(full, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))
        return text[:text.index(old)].count("\n") + 1

    def append(self, path, line):
        """Appends a line to path; returns its number."""
        full = os.path.join(self.root, path)
        with open(full, encoding="utf-8") as f:
            count = f.read().count("\n")
        with open(full, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        return count + 1

    def test_the_copy_passes_as_the_tree_does(self):
        self.assertEqual(layering.check(self.root), [])

    def test_an_include_up_fails_and_names_the_missing_link(self):
        line = self.append("server/feed/feed.h", '#include "server/session/session.h"')
        self.assertEqual(layering.check(self.root), [
            f"server/feed/feed.h:{line}: server/feed (layer 7) includes server/session/session.h "
            f"of server/session, a higher layer (8): an include may only run down (move what "
            f"both need below them)",
            f"{BUILD}: gpufeed_feed does not link gpufeed_session, yet server/feed includes "
            f"server/session",
        ])

    def test_an_include_across_one_layer_fails(self):
        line = self.append("server/reader/npy.h", '#include "server/sampler/sampler.h"')
        self.assertEqual(layering.check(self.root), [
            f"server/reader/npy.h:{line}: server/reader (layer 4) includes "
            f"server/sampler/sampler.h of server/sampler, the same layer (4): an include may "
            f"only run down (move what both need below them)",
            f"{BUILD}: gpufeed_reader does not link gpufeed_sampler, yet server/reader includes "
            f"server/sampler",
        ])

    def test_a_link_up_fails(self):
        line = self.edit(BUILD, "PUBLIC gpufeed_common gpufeed_auth gpufeed_reader gpufeed_sampler",
                         "PUBLIC gpufeed_common gpufeed_auth gpufeed_reader gpufeed_sampler "
                         "gpufeed_session")
        self.assertEqual(layering.check(self.root), [
            f"{BUILD}:{line}: gpufeed_feed (server/feed, layer 7) links gpufeed_session of "
            f"server/session, a higher layer (8): a link may only run down",
            f"{BUILD}: gpufeed_feed links gpufeed_session, yet server/feed includes nothing of it",
        ])

    def test_a_missing_link_fails(self):
        self.edit(BUILD, "gpufeed_reader gpufeed_sampler gpufeed_images",
                  "gpufeed_reader gpufeed_images")
        self.assertEqual(layering.check(self.root), [
            f"{BUILD}: gpufeed_feed does not link gpufeed_sampler, yet server/feed includes "
            f"server/sampler",
        ])

    def test_the_umbrella_is_for_tests_only(self):
        line = self.edit(BUILD, "target_link_libraries(gpufeed_staging PUBLIC gpufeed_common",
                         "target_link_libraries(gpufeed_staging PUBLIC gpufeed_common gpufeed_core")
        self.assertEqual(layering.check(self.root), [
            f"{BUILD}:{line}: gpufeed_staging links gpufeed_core, the tests' umbrella: link the "
            f"libraries it uses",
        ])

    def test_the_core_links_no_grpc(self):
        line = self.edit(BUILD, "target_link_libraries(gpufeed_staging PUBLIC gpufeed_common",
                         "target_link_libraries(gpufeed_staging PUBLIC gpufeed_common "
                         "gRPC::grpc++")
        self.assertEqual(layering.check(self.root), [
            f"{BUILD}:{line}: the core (gpufeed_staging) links gRPC::grpc++: only "
            f"server/service/ knows gRPC",
        ])

    def test_a_source_of_another_folder_fails(self):
        line = self.edit(BUILD, "add_library(gpufeed_decode STATIC decode/image_decoder.cc",
                         "add_library(gpufeed_decode STATIC decode/image_decoder.cc "
                         "augment/resize.cc")
        self.assertEqual(layering.check(self.root), [
            f"{BUILD}:{line}: gpufeed_decode (server/decode) compiles augment/resize.cc of "
            f"server/augment: a library holds its own folder only",
        ])

    def test_a_library_named_after_no_folder_fails(self):
        line = self.append(BUILD, "add_library(gpufeed_misc STATIC misc/misc.cc)")
        self.assertEqual(layering.check(self.root), [
            f"{BUILD}:{line}: gpufeed_misc is named after no folder of server/ "
            f"(gpufeed_<folder>, or gpufeed_daemon)",
        ])

    def test_a_new_folder_needs_a_layer(self):
        os.mkdir(os.path.join(self.root, "server", "blend"))
        with open(os.path.join(self.root, "server", "blend", "blend.h"), "w") as f:
            f.write("#pragma once\n")
        self.assertEqual(layering.check(self.root), [
            f"server/blend/blend.h: folder server/blend has no layer in {layering.__file__}",
        ])


if __name__ == "__main__":
    unittest.main(verbosity=1)
