{{/*
Chart name, truncated to the 63 characters of a DNS label.
*/}}
{{- define "receipts.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: "<release>-<chart>", or the release name when it already contains the chart
name. Resource names derive from it (CronJob names are limited to 52 characters).
*/}}
{{- define "receipts.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "receipts.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: frozen (a Deployment's selector cannot change after install).
*/}}
{{- define "receipts.selectorLabels" -}}
app.kubernetes.io/name: {{ include "receipts.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels for every object; pass a dict with "ctx" (the root context) and, for objects of one
component (worker, recovery, migration, dashboard), "component". Objects several
components share (ConfigMap, Secret, ServiceAccount, alert rules) carry no component label.
*/}}
{{- define "receipts.labels" -}}
helm.sh/chart: {{ include "receipts.chart" .ctx }}
{{ include "receipts.selectorLabels" .ctx }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/part-of: receipts
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of the worker pods.
*/}}
{{- define "receipts.workerSelectorLabels" -}}
{{ include "receipts.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "receipts.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "receipts.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "receipts.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding RECEIPTS_DATABASE_URL and RECEIPTS_PROVIDER_TOKEN.
*/}}
{{- define "receipts.secretName" -}}
{{- default (include "receipts.fullname" .) .Values.secret.existingSecret }}
{{- end }}

{{/*
Secret environment variables (from the Secret, never from the ConfigMap).
Pass a dict with "ctx" (root) and "secretName".
*/}}
{{- define "receipts.secretEnv" -}}
- name: RECEIPTS_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .ctx.Values.secret.databaseUrlKey }}
- name: RECEIPTS_PROVIDER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .ctx.Values.secret.providerTokenKey }}
      optional: true
{{- end }}

{{/*
Non-secret settings as a map NAME: "value" (the ConfigMap data, and the migration hook's
inline env, which runs before the ConfigMap exists): the chart's own, then config.extraEnv.
*/}}
{{- define "receipts.configData" -}}
{{ include "receipts.chartConfigData" . }}
{{- range $k, $v := .Values.config.extraEnv }}
{{ $k }}: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/*
The settings the chart sets from its config values.
*/}}
{{- define "receipts.chartConfigData" -}}
{{- $c := .Values.config -}}
RECEIPTS_PROVIDER_URL: {{ $c.providerUrl | quote }}
RECEIPTS_CONCURRENCY: {{ $c.concurrency | int | quote }}
RECEIPTS_LEASE_SECONDS: {{ $c.leaseSeconds | int | quote }}
RECEIPTS_LEASE_MARGIN_SECONDS: {{ $c.leaseMarginSeconds | int | quote }}
RECEIPTS_MAX_ATTEMPTS: {{ $c.maxAttempts | int | quote }}
RECEIPTS_DELIVERY_TIMEOUT_SECONDS: {{ $c.deliveryTimeoutSeconds | toString | quote }}
RECEIPTS_POLL_INTERVAL_SECONDS: {{ $c.pollIntervalSeconds | toString | quote }}
RECEIPTS_CLAIM_BATCH_MAX: {{ $c.claimBatchMax | int | quote }}
RECEIPTS_METRICS_PORT: {{ .Values.metrics.port | int | quote }}
RECEIPTS_LOG_LEVEL: {{ $c.logLevel | quote }}
RECEIPTS_POOL_MAX_SIZE: {{ $c.poolMaxSize | int | quote }}
RECEIPTS_LISTEN_NOTIFY: {{ and $c.listenNotify (not $c.pgbouncer) | toString | quote }}
RECEIPTS_PGBOUNCER: {{ $c.pgbouncer | toString | quote }}
{{- with $c.databaseSchema }}
RECEIPTS_DATABASE_SCHEMA: {{ . | quote }}
{{- end }}
RECEIPTS_SHUTDOWN_GRACE_SECONDS: {{ $c.shutdownGraceSeconds | toString | quote }}
RECEIPTS_RETRY_BASE_SECONDS: {{ $c.retryBaseSeconds | toString | quote }}
RECEIPTS_RETRY_CAP_SECONDS: {{ $c.retryCapSeconds | toString | quote }}
RECEIPTS_RETENTION_DAYS: {{ $c.retentionDays | int | quote }}
RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS: {{ $c.queueStatsIntervalSeconds | toString | quote }}
RECEIPTS_STATEMENT_TIMEOUT_SECONDS: {{ $c.statementTimeoutSeconds | toString | quote }}
RECEIPTS_LOCK_TIMEOUT_SECONDS: {{ $c.lockTimeoutSeconds | toString | quote }}
{{- with $c.pushgatewayUrl }}
RECEIPTS_PUSHGATEWAY_URL: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Most worker pods the autoscaler (or the fixed replica count) asks for.
*/}}
{{- define "receipts.maxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.maxReplicas | int }}{{ else }}{{ .Values.worker.replicaCount | int }}{{ end }}
{{- end }}

{{/*
An int-or-percent value (maxSurge, maxUnavailable) as pods out of "replicas", rounded up
(the worst case for the connection budget). Pass a dict with "value" and "replicas".
*/}}
{{- define "receipts.podsOf" -}}
{{- $v := toString .value -}}
{{- if hasSuffix "%" $v -}}
{{- div (add (mul ($v | trimSuffix "%" | int) (.replicas | int)) 99) 100 -}}
{{- else -}}
{{- $v | int -}}
{{- end -}}
{{- end }}

{{/*
Connection budget arithmetic, as a dict of ints (JSON). Worker pods beyond maxReplicas:
a rollout adds up to maxSurge new pods while up to maxUnavailable old ones still drain
(a terminating pod keeps its connections until it exits, and the Deployment does not wait
for it before starting the replacement); a voluntary eviction likewise starts a
replacement while the evicted pod drains, at most podDisruptionBudget.maxUnavailable at
once. The surge is maxSurge + the larger of the two.
*/}}
{{- define "receipts.connections" -}}
{{- $c := .Values.config -}}
{{- $listener := ternary 1 0 (and $c.listenNotify (not $c.pgbouncer)) -}}
{{- $perPod := add ($c.poolMaxSize | int) $listener -}}
{{- $replicas := include "receipts.maxReplicas" . | int -}}
{{- $maxSurge := include "receipts.podsOf" (dict "value" .Values.worker.maxSurge "replicas" $replicas) | int -}}
{{- $draining := include "receipts.podsOf" (dict "value" .Values.worker.maxUnavailable "replicas" $replicas) | int -}}
{{- if .Values.podDisruptionBudget.enabled }}
{{- $draining = max $draining (include "receipts.podsOf" (dict "value" .Values.podDisruptionBudget.maxUnavailable "replicas" $replicas) | int) -}}
{{- end }}
{{- $surge := add $maxSurge $draining -}}
{{- $recovery := ternary 1 0 .Values.recovery.enabled -}}
{{- $migration := ternary 1 0 .Values.migration.enabled -}}
{{- $keda := ternary 1 0 (and .Values.autoscaling.enabled .Values.autoscaling.keda.enabled) -}}
{{- $reserved := .Values.connectionBudget.reserved | int -}}
{{- $ui := ternary (mul 2 (.Values.ui.replicas | int)) 0 .Values.ui.enabled -}}
{{- $total := add (mul (add $replicas $surge) $perPod) $recovery $migration $keda $reserved $ui -}}
{{- dict "replicas" $replicas "surge" $surge "pool" ($c.poolMaxSize | int) "listener" $listener "perPod" $perPod "recovery" $recovery "migration" $migration "keda" $keda "reserved" $reserved "ui" $ui "total" $total "budget" (.Values.connectionBudget.maxConnections | int) | toJson }}
{{- end }}

{{/*
One line of connection arithmetic for messages and NOTES.txt.
*/}}
{{- define "receipts.connectionsLine" -}}
{{- $n := include "receipts.connections" . | fromJson -}}
{{- $ui := ternary (printf " + review page %d" (int $n.ui)) "" (gt (int $n.ui) 0) -}}
{{- printf "(%d max replicas + %d rollout surge) × %d per pod (pool %d + listener %d) + recovery %d + migration %d + KEDA %d + reserved %d%s = %d connections; budget %d" (int $n.replicas) (int $n.surge) (int $n.perPod) (int $n.pool) (int $n.listener) (int $n.recovery) (int $n.migration) (int $n.keda) (int $n.reserved) $ui (int $n.total) (int $n.budget) }}
{{- end }}

{{/*
The connection budget formula in words, for the fail message.
*/}}
{{- define "receipts.connectionsFormula" -}}
(maxReplicas + worker.maxSurge + max(worker.maxUnavailable, podDisruptionBudget.maxUnavailable)) × (config.poolMaxSize + 1 listener unless config.listenNotify=false or config.pgbouncer=true) + 1 recovery + 1 migration + 1 KEDA scaler (each when enabled) + connectionBudget.reserved must not exceed connectionBudget.maxConnections
{{- end }}

{{/*
The worker's stop budget in seconds (float), from the settings the chart renders; the same
formula as the worker's Settings.stop_budget_seconds: in-flight deliveries
min(grace, delivery timeout) + ack flush max(5, min(grace, 30)) + pool close 5.
*/}}
{{- define "receipts.stopBudgetSeconds" -}}
{{- $data := include "receipts.configData" . | fromYaml -}}
{{- $grace := $data.RECEIPTS_SHUTDOWN_GRACE_SECONDS | float64 -}}
{{- $timeout := $data.RECEIPTS_DELIVERY_TIMEOUT_SECONDS | float64 -}}
{{- addf (minf $grace $timeout) (maxf 5.0 (minf $grace 30.0)) 5.0 -}}
{{- end }}

{{/*
Seconds Kubernetes waits after SIGTERM when none is set: the stop budget rounded up, plus
5 s for the signal to arrive and the interpreter to exit.
*/}}
{{- define "receipts.minTerminationGracePeriodSeconds" -}}
{{- add (include "receipts.stopBudgetSeconds" . | float64 | ceil | int) 5 -}}
{{- end }}

{{- define "receipts.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.worker.terminationGracePeriodSeconds }}
{{- include "receipts.minTerminationGracePeriodSeconds" . }}
{{- else }}
{{- .Values.worker.terminationGracePeriodSeconds | int }}
{{- end }}
{{- end }}

{{/*
KEDA's target per pod: the jobs (due or in flight) one pod should carry, its slots ×
autoscaling.keda.utilisation, at least 1.
*/}}
{{- define "receipts.kedaTarget" -}}
{{- max 1 (mulf (.Values.config.concurrency | float64) (.Values.autoscaling.keda.utilisation | float64) | floor | int) -}}
{{- end }}

{{/*
The scaling signal (one statement, served by the partial indexes receipt_jobs_ready and
receipt_jobs_expired): due, claimable ready jobs + running jobs whose lease is live.
While the fleet is paused (a receipt_flow row with a pause_reason) due jobs do not count:
running jobs count at the target's share of a pod, ceil(running × target / slots), so the
fleet keeps the pods that hold them and asks for no more, and at least 1 while jobs wait,
so one pod stays to see the pause end. Each count stops at maxReplicas × target: more
would not change KEDA's answer, and the statement's cost stays bounded by it. Tables are
qualified with config.databaseSchema when it is set (else KEDA's DSN's search_path applies).
*/}}
{{- define "receipts.kedaQuery" -}}
{{- $target := include "receipts.kedaTarget" . | int -}}
{{- $slots := .Values.config.concurrency | int -}}
{{- $cap := mul (.Values.autoscaling.maxReplicas | int) $target -}}
{{- $s := "" -}}
{{- with .Values.config.databaseSchema }}{{ $s = printf "%q." . }}{{ end -}}
WITH flow AS (
  SELECT EXISTS (SELECT FROM {{ $s }}receipt_flow WHERE pause_reason IS NOT NULL) AS paused
), due AS (
  SELECT count(*) AS n FROM (
    SELECT FROM {{ $s }}receipt_jobs
    WHERE state = 'ready' AND run_at <= statement_timestamp() AND attempts < {{ .Values.config.maxAttempts | int }}
    LIMIT CASE WHEN (SELECT paused FROM flow) THEN 1 ELSE {{ $cap }} END
  ) AS d
), busy AS (
  SELECT count(*) AS n FROM (
    SELECT FROM {{ $s }}receipt_jobs
    WHERE state = 'running' AND lease_until > statement_timestamp()
    LIMIT {{ $cap }}
  ) AS b
)
SELECT CASE WHEN flow.paused THEN greatest((busy.n * {{ $target }} + {{ sub $slots 1 }}) / {{ $slots }}, due.n)
            ELSE due.n + busy.n END
FROM flow, due, busy
{{- end }}

{{/*
nodeSelector, tolerations and affinity of a pod. Pass a dict with "ctx" (root) and "pod"
(the component's values): a key left null there takes the worker's value.
*/}}
{{- define "receipts.scheduling" -}}
{{- $worker := .ctx.Values.worker -}}
{{- range $key := list "nodeSelector" "affinity" "tolerations" }}
{{- $value := index $.pod $key -}}
{{- if kindIs "invalid" $value }}{{ $value = index $worker $key }}{{ end }}
{{- with $value }}
{{ $key }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Checks of value combinations; included by every workload template, renders nothing.
*/}}
{{- define "receipts.validate" -}}
{{- $n := include "receipts.connections" . | fromJson -}}
{{- if gt (int $n.total) (int $n.budget) }}
{{- fail (printf "connection budget exceeded: %s. The rule: %s. Lower autoscaling.maxReplicas (or worker.replicaCount), worker.maxSurge or config.poolMaxSize, set config.listenNotify=false or config.pgbouncer=true, or raise connectionBudget.maxConnections." (include "receipts.connectionsLine" .) (include "receipts.connectionsFormula" .)) }}
{{- end }}
{{- if and (has (toString .Values.worker.maxSurge) (list "0" "0%")) (has (toString .Values.worker.maxUnavailable) (list "0" "0%")) }}
{{- fail "worker.maxSurge and worker.maxUnavailable cannot both be 0: a rollout could never replace a pod." }}
{{- end }}
{{- $c := .Values.config -}}
{{- $own := include "receipts.chartConfigData" . | fromYaml -}}
{{- range $key := keys $c.extraEnv | sortAlpha }}
{{- if hasKey $own $key }}
{{- fail (printf "config.extraEnv sets %s, which the chart already sets from its config values: set that value instead." $key) }}
{{- end }}
{{- end }}
{{- if gt (float64 $c.deliveryTimeoutSeconds) (float64 (sub ($c.leaseSeconds | int) ($c.leaseMarginSeconds | int))) }}
{{- fail (printf "config.deliveryTimeoutSeconds (%v) must be <= config.leaseSeconds (%v) - config.leaseMarginSeconds (%v): a delivery must end before its lease can expire." $c.deliveryTimeoutSeconds $c.leaseSeconds $c.leaseMarginSeconds) }}
{{- end }}
{{- $minGrace := include "receipts.minTerminationGracePeriodSeconds" . | int -}}
{{- if lt (include "receipts.terminationGracePeriodSeconds" . | int) $minGrace }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%v) is below %d: the worker's stop budget is %v s (in-flight deliveries min(config.shutdownGraceSeconds, config.deliveryTimeoutSeconds) + ack flush max(5, min(config.shutdownGraceSeconds, 30)) + pool close 5) and 5 s are added for the signal and the exit; Kubernetes would kill a worker that is still draining. Leave it empty (null) or set at least %d." .Values.worker.terminationGracePeriodSeconds $minGrace (include "receipts.stopBudgetSeconds" .) $minGrace) }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- if gt (.Values.autoscaling.minReplicas | int) (.Values.autoscaling.maxReplicas | int) }}
{{- fail (printf "autoscaling.minReplicas (%v) must be <= autoscaling.maxReplicas (%v)." .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) }}
{{- end }}
{{- if and (eq (.Values.autoscaling.minReplicas | int) 0) (not .Values.autoscaling.keda.enabled) }}
{{- fail "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.keda.enabled=true; a plain HPA cannot scale to zero." }}
{{- end }}
{{- if and .Values.autoscaling.keda.enabled $c.pgbouncer (not .Values.autoscaling.keda.poolerCompatible) }}
{{- fail "autoscaling.keda.enabled with config.pgbouncer=true: KEDA's postgresql scaler (the pgx driver) prepares and caches its statements, which a transaction pooler breaks (\"prepared statement ... does not exist\") unless it supports protocol-level prepared statements (PgBouncer 1.21+ with max_prepared_statements > 0). Point autoscaling.keda.connectionKey at a DSN that reaches PostgreSQL directly or ends in default_query_exec_mode=simple_protocol, or upgrade the pooler; then set autoscaling.keda.poolerCompatible=true." }}
{{- end }}
{{- end }}
{{- end }}

{{/*
PromQL label matchers of this service's series.
*/}}
{{- define "receipts.alertSelector" -}}
{{- default (printf "job=\"%s\"" (include "receipts.fullname" .)) .Values.alerts.selector }}
{{- end }}

{{/*
Writable /tmp (the root filesystem is read-only).
*/}}
{{- define "receipts.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}
