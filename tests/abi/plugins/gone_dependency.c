/* Not a plugin: a shared library the plugin needs_gone links to, built outside the plugin folder
 * and never on the loader's path, so that loading needs_gone fails as a plugin with a missing
 * dependency does (libcudart not found, say). */
__attribute__((visibility("default"))) int hr_test_gone_value(void);

__attribute__((visibility("default"))) int hr_test_gone_value(void) {
  return 7;
}
