/**
 * forkd: microVM sandboxes forked from warm snapshots, from TypeScript.
 *
 * ```ts
 * import { Sandbox } from "forkd";
 * const sbx = await Sandbox.create("python");
 * console.log((await sbx.commands.run("uname -r")).stdout);
 * await sbx.kill();
 * ```
 */

export { Connection, defaultSocket } from "./connection.js";
export type { ConnectionOptions } from "./connection.js";
export * from "./errors.js";
export { Pty, PtyHandle, TerminalClosedError } from "./pty.js";
export type { PtyCreateOptions } from "./pty.js";
export { CommandHandle, Commands, Files, Sandbox, Snapshot, WatchHandle } from "./sandbox.js";
export type {
  BackgroundOptions,
  CodeContext,
  CommandResult,
  CreateOptions,
  EntryInfo,
  Execution,
  FilesystemEvent,
  ExecutionError,
  Limits,
  Network,
  OutputHandler,
  ProcessInfo,
  Result,
  RunCodeOptions,
  RunOptions,
  SandboxInfo,
  SandboxLimits,
  SandboxNetwork,
} from "./sandbox.js";
