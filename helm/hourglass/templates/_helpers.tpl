{{/* Names, labels and shared snippets of the Hourglass chart. */}}

{{- define "hourglass.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* release-scoped prefix; kept short enough that every StatefulSet name stays <= 52 characters (30 + "-realtime-" + a 12-character group name) */}}
{{- define "hourglass.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hourglass.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hourglass.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hourglass.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hourglass.labels" -}}
helm.sh/chart: {{ include "hourglass.chart" . }}
{{ include "hourglass.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hourglass
{{- end -}}

{{- define "hourglass.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "hourglass.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "hourglass.metaserverName" -}}
{{- printf "%s-metaserver" (include "hourglass.fullname" .) -}}
{{- end -}}

{{/* what nodes and clients bootstrap from: the meta server Service, as host:port */}}
{{- define "hourglass.metaserverAddress" -}}
{{- printf "%s.%s:%d" (include "hourglass.metaserverName" .) (include "hourglass.svcDomain" .) (int .Values.metaserver.port) -}}
{{- end -}}

{{- define "hourglass.etcdName" -}}
{{- printf "%s-etcd" (include "hourglass.fullname" .) -}}
{{- end -}}

{{/* comma-separated etcd client endpoints (host:port) for the meta servers, which fail over between them */}}
{{- define "hourglass.etcdEndpoints" -}}
{{- if .Values.etcd.bundled -}}
{{- $name := include "hourglass.etcdName" . -}}
{{- $out := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $out = append $out (printf "%s-%d.%s-headless.%s:%d" $name $i $name (include "hourglass.svcDomain" $) (int $.Values.etcd.clientPort)) -}}
{{- end -}}
{{- join "," $out -}}
{{- else -}}
{{- if not .Values.etcd.externalEndpoints -}}
{{- fail "etcd.bundled is false: set etcd.externalEndpoints to the client endpoints (host:port) of your etcd cluster" -}}
{{- end -}}
{{- $out := list -}}
{{- range .Values.etcd.externalEndpoints -}}
{{- $out = append $out (trimPrefix "http://" . | trimSuffix "/") -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}
{{- end -}}

{{/* pod anti-affinity over the pods matching (dict "root" $ "labels" $selector) */}}
{{- define "hourglass.antiAffinity" -}}
{{- $root := .root -}}
{{- if eq $root.Values.antiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: {{ $root.Values.antiAffinityTopologyKey }}
      labelSelector:
        matchLabels:
          {{- toYaml .labels | nindent 10 }}
{{- else if eq $root.Values.antiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: {{ $root.Values.antiAffinityTopologyKey }}
        labelSelector:
          matchLabels:
            {{- toYaml .labels | nindent 12 }}
{{- end -}}
{{- end -}}

{{/* checks across values that a JSON schema cannot express */}}
{{- define "hourglass.validate" -}}
{{- $seen := dict -}}
{{- range $role, $groups := dict "delay" .Values.delayGroups "realtime" .Values.realtimeGroups -}}
{{- range $groups -}}
{{- $key := printf "%s/%s" $role .name -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "%sGroups: group name %q appears twice; every group needs its own name" $role .name) -}}
{{- end -}}
{{- $_ := set $seen $key true -}}
{{- $ack := default $.Values.nodes.ackMode .ackMode -}}
{{- if and (eq $ack "sync") (lt (int .replicas) 2) -}}
{{- fail (printf "%sGroups[%s]: ackMode sync waits for a slave, so replicas must be at least 2 (got %d)" $role .name (int .replicas)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- security (docs/security.md) */}}

{{/* the DNS name every Hourglass certificate carries and every TLS client checks (HOURGLASS_TLS_SERVER_NAME) */}}
{{- define "hourglass.serverName" -}}
{{- default (printf "%s.%s.hourglass" (include "hourglass.fullname" .) .Release.Namespace) .Values.security.serverName -}}
{{- end -}}

{{/* where certificates come from: helm | cert-manager | existing ("auto" resolved) */}}
{{- define "hourglass.certSource" -}}
{{- $src := .Values.security.certificates -}}
{{- if eq $src "auto" -}}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" -}}cert-manager{{- else -}}helm{{- end -}}
{{- else -}}{{ $src }}{{- end -}}
{{- end -}}

{{/* Secret names: the node certificate (ca.crt, tls.crt, tls.key), etcd's, the client's, the tokens.
Three trusts, kept apart (docs/security.md): the node CA (nodes, meta servers; every client checks
servers with it), the client CA (client certificates; servers accept them as clients only) and
etcd's CA (etcd members and the meta servers' etcd-client certificate; nothing else opens etcd). */}}
{{- define "hourglass.tlsSecret" -}}
{{- if eq (include "hourglass.certSource" .) "existing" -}}
{{- required "security.certificates=existing: set security.existingSecrets.tls" .Values.security.existingSecrets.tls -}}
{{- else -}}{{ printf "%s-tls" (include "hourglass.fullname" .) }}{{- end -}}
{{- end -}}
{{- define "hourglass.etcdTlsSecret" -}}
{{- if eq (include "hourglass.certSource" .) "existing" -}}
{{- required "security.certificates=existing with the bundled etcd: set security.existingSecrets.etcd (etcd's serving certificate and its own CA, which must not sign any node or client certificate)" .Values.security.existingSecrets.etcd -}}
{{- else -}}{{ printf "%s-etcd-tls" (include "hourglass.fullname" .) }}{{- end -}}
{{- end -}}
{{/* the meta servers' certificate for etcd (ca.crt = etcd's CA): bundled etcd, or etcd.externalTlsSecret */}}
{{- define "hourglass.etcdClientSecret" -}}
{{- if not .Values.etcd.bundled -}}{{ .Values.etcd.externalTlsSecret }}
{{- else if eq (include "hourglass.certSource" .) "existing" -}}
{{- required "security.certificates=existing with the bundled etcd: set security.existingSecrets.etcdClient (the meta servers' client certificate, signed by etcd's CA)" .Values.security.existingSecrets.etcdClient -}}
{{- else -}}{{ printf "%s-etcd-client-tls" (include "hourglass.fullname" .) }}{{- end -}}
{{- end -}}
{{/* the Secret whose ca.crt is the client CA's certificate ("" = none: clients signed by the node CA) */}}
{{- define "hourglass.clientCaSecret" -}}
{{- $src := include "hourglass.certSource" . -}}
{{- if eq $src "existing" -}}{{ .Values.security.existingSecrets.clientCa }}
{{- else if eq $src "cert-manager" -}}{{ printf "%s-client-tls" (include "hourglass.fullname" .) }}
{{- else -}}{{ printf "%s-client-ca" (include "hourglass.fullname" .) }}{{- end -}}
{{- end -}}
{{- define "hourglass.authSecret" -}}
{{- default (printf "%s-auth" (include "hourglass.fullname" .)) .Values.security.authSecret -}}
{{- end -}}

{{/* env of a node or meta server pod with security on */}}
{{- define "hourglass.securityEnv" -}}
- name: HOURGLASS_TLS_CA_FILE
  value: /etc/hourglass/tls/ca.crt
- name: HOURGLASS_TLS_CERT_FILE
  value: /etc/hourglass/tls/tls.crt
- name: HOURGLASS_TLS_KEY_FILE
  value: /etc/hourglass/tls/tls.key
- name: HOURGLASS_TLS_SERVER_NAME
  value: {{ include "hourglass.serverName" . }}
- name: HOURGLASS_AUTH_FILE
  value: /etc/hourglass/auth/auth.json
{{- if include "hourglass.clientCaSecret" . }}
- name: HOURGLASS_TLS_CLIENT_CA_FILE
  value: /etc/hourglass/client-ca/ca.crt
{{- end }}
{{- end -}}

{{- define "hourglass.securityMounts" -}}
- name: tls
  mountPath: /etc/hourglass/tls
  readOnly: true
- name: auth
  mountPath: /etc/hourglass/auth
  readOnly: true
{{- if include "hourglass.clientCaSecret" . }}
- name: client-ca
  mountPath: /etc/hourglass/client-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/* Secrets are mounted as folders (not subPath) so Kubernetes updates them in place: rotation */}}
{{- define "hourglass.securityVolumes" -}}
- name: tls
  secret:
    secretName: {{ include "hourglass.tlsSecret" . }}
    defaultMode: 0440
- name: auth
  secret:
    secretName: {{ include "hourglass.authSecret" . }}
    defaultMode: 0440
{{- with include "hourglass.clientCaSecret" . }}
- name: client-ca
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:   # the CA's certificate only, never a key that Secret may hold
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}
