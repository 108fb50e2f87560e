/**
 * Errors the daemon answers with, as exceptions: one class per kind of failure. Every
 * error response is `{"error": {"code", "message"}}`; `errorFor` maps its code (and
 * failing that its HTTP status) to a class here.
 */

/** Any error from forkd: `status` is the HTTP status, `code` the API's error code. */
export class ForkdError extends Error {
  constructor(
    message: string,
    readonly status = 0,
    readonly code = "",
  ) {
    super(message);
    this.name = new.target.name;
  }
}

/** The request was malformed (a bad tag, path, field or value). */
export class BadRequestError extends ForkdError {}
/** No token, or a wrong one (TCP listeners need `FORKD_TOKEN`). */
export class AuthError extends ForkdError {}
/** The guest refused the operation (permissions). */
export class ForbiddenError extends ForkdError {}
/** No such sandbox, snapshot, operation, process or guest file. */
export class NotFoundError extends ForkdError {}
/** The thing exists, is in use, or is not in a state that allows this. */
export class ConflictError extends ForkdError {}
/** The request or upload passed a limit. */
export class TooLargeError extends ForkdError {}
/** The daemon has no room: its sandbox limit or the host's memory (retry later). */
export class CapacityError extends ForkdError {}
/** The data directory's disk is too full for this. */
export class StorageError extends ForkdError {}
/** The sandbox's VM died or broke. */
export class SandboxFailedError extends ForkdError {}
/** No daemon answers at the URL tried (it is stopped, or the URL or socket is wrong). */
export class UnreachableError extends ForkdError {}
/** The sandbox did not answer in time, or a wait ran out. */
export class TimeoutError extends ForkdError {}

type ErrorClass = new (message: string, status?: number, code?: string) => ForkdError;

const byCode: Record<string, ErrorClass> = {
  bad_request: BadRequestError,
  unauthorized: AuthError,
  forbidden: ForbiddenError,
  not_found: NotFoundError,
  conflict: ConflictError,
  too_large: TooLargeError,
  at_capacity: CapacityError,
  insufficient_memory: CapacityError,
  sandbox_unresponsive: TimeoutError,
  insufficient_storage: StorageError,
  sandbox_failed: SandboxFailedError,
};

const byStatus: Record<number, ErrorClass> = {
  400: BadRequestError,
  401: AuthError,
  403: ForbiddenError,
  404: NotFoundError,
  409: ConflictError,
  413: TooLargeError,
  502: SandboxFailedError,
  503: CapacityError,
  507: StorageError,
};

/** The exception for an error response with this status and decoded JSON body. */
export function errorFor(status: number, body: unknown): ForkdError {
  let code = "";
  let message = "";
  if (typeof body === "object" && body !== null && "error" in body) {
    const e = (body as { error: { code?: unknown; message?: unknown } }).error;
    code = typeof e?.code === "string" ? e.code : "";
    message = typeof e?.message === "string" ? e.message : "";
  }
  const Cls = byCode[code] ?? byStatus[status] ?? ForkdError;
  return new Cls(message || `forkd answered HTTP ${status}`, status, code);
}
